# Two commands on a fresh machine: `make serve` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0

.PHONY: serve test check lint types bench proto env clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	# CPU build of torch only (tests pass torch CPU tensors); never a loose range.
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	@command -v redis-server >/dev/null || { \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null 2>&1 || \
	  echo "warning: redis-server not installed; Redis comparisons in benchmarks are skipped"; }
	@touch $(STAMP)

env: $(STAMP)

serve: $(STAMP)
	@mkdir -p run
	$(BIN)/kvtier serve

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

check: lint types test

lint: $(STAMP)
	$(BIN)/ruff check client server tests scripts

types: $(STAMP)
	$(BIN)/mypy client/kvtier server/kvtierd

bench: $(STAMP)
	$(BIN)/kvtier bench

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) run build *.egg-info
