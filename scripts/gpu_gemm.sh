#!/usr/bin/env bash
# One GPU call for the FP8 block-scaled GEMM: its GPU tests (Triton against the reference, CUDA
# graph capture, no host sync), a compute-sanitizer memcheck pass, then the benchmark with the
# sweep of every candidate launch shape. Logs, the Markdown tables and the sweep's JSON land
# under $OUT (default /tmp/flashdsa-gpu).
# Run on the device machine as:  source .device/env.sh && FLASHDSA_COMMIT=<sha> bash scripts/gpu_gemm.sh [tests|bench]
# (no argument: both; each part alone fits one 10-minute device command).
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
part=${1:-all}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
status=0
if [[ $part == all || $part == tests ]]; then
  python3 -m pytest -q -m gpu -rfE tests/gemm 2>&1 | tee "$out/gemm-tests.log" || status=1
  if command -v compute-sanitizer >/dev/null; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gemm/test_triton_fp8_gemm.py --memcheck \
      2>&1 | tail -n 20 | tee "$out/gemm-memcheck.log" || status=1
  fi
fi
if [[ $part == all || $part == bench ]]; then
  python3 benchmarks/bench_gemm.py --sweep --sweep-json "$out/gemm-sweep.json" --output "$out/BENCHMARKS-gemm.md" \
    2>&1 | tee "$out/gemm-bench.log" || status=1
fi
exit $status
