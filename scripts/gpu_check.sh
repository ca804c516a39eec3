#!/usr/bin/env bash
# The prepared GPU check (issue 4), for one `device` run on a CUDA machine:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=480)
# It runs the GPU-marked tests and `kvtier bench gpu` (shm and cuda_ipc; the image has cupy),
# writing logs and JSON under $OUT.
# The device image has torch, grpcio, protobuf, uvloop, prometheus-client and pytest but not
# kvtier or xxhash: kvtier runs from the tree (PYTHONPATH), xxhash comes from .whl/ (fetch it
# with `pip download xxhash==4.1.0 --only-binary=:all: -d .whl` for the image's Python).
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/client:$PWD/server:$PWD/tests" PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF  # expandable segments cannot be exported over CUDA IPC
python -c "import xxhash" 2>/dev/null || pip install -q --no-index --find-links .whl xxhash
{ nvidia-smi; python -c "import torch; print(torch.__version__, torch.version.cuda)";
  python -c "import cupy; print('cupy', cupy.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
timeout 270 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" \
  2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 170 python -m kvtier.cli bench gpu --json "$OUT/bench_gpu.json" \
  2>&1 | tee "$OUT/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc, bench rc=$bench_rc" | tee "$OUT/rc.txt"
exit $(( tests_rc != 0 ? tests_rc : bench_rc ))
