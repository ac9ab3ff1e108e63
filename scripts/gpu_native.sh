#!/usr/bin/env bash
# One GPU call for the native (CUDA C++) kernels: build them (timed: the first use's JIT cost),
# their GPU tests against the reference, a compute-sanitizer memcheck pass over edge cases, then
# the top-k benchmark with the cuda column. Writes at most 6 files under $OUT (default
# /tmp/flashdsa-gpu): device.txt, build.log, tests.log, memcheck.log, bench.log, BENCHMARKS-native.md.
# Run on the device machine (Hopper) as:  bash scripts/gpu_native.sh
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
mkdir -p "$out"
export FLASHDSA_CACHE_DIR=${FLASHDSA_CACHE_DIR:-/tmp/flashdsa-kernels}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
{ nvcc --version | tail -n 2; python3 -c 'import torch; print("torch", torch.__version__)'; } | tee -a "$out/device.txt"
status=0
{ time python3 -m flashdsa.cli build-kernels --compile-only && time python3 -m flashdsa.cli build-kernels; } \
  2>&1 | tee "$out/build.log" || status=1
python3 -m pytest -q -rfEs tests/native tests/indexer/test_cuda_topk.py tests/indexer/test_triton_indexer.py -k "topk or native or build" \
  2>&1 | tee "$out/tests.log" || status=1
if command -v compute-sanitizer >/dev/null; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 tests/indexer/test_cuda_topk.py --memcheck 2>&1 | tail -n 20 | tee "$out/memcheck.log" || status=1
fi
python3 -m benchmarks.bench_topk --output "$out/BENCHMARKS-native.md" 2>&1 | tee "$out/bench.log" || status=1
exit $status
