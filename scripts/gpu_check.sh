#!/usr/bin/env bash
# One GPU call that checks and times everything: the GPU tests (kernels against the reference,
# compute-sanitizer passes, model and training checks) and the kernel benchmarks.
# Run on the device machine as:  source .device/env.sh && FLASHDSA_COMMIT=<sha> bash scripts/gpu_check.sh
# Full logs and the benchmark tables land under $OUT (default /tmp/flashdsa-gpu).
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
status=0
python3 -m pytest -q -m gpu -rfE tests "${@}" 2>&1 | tee "$out/gpu-tests.log" || status=1
for bench in benchmarks/bench_kernels.py benchmarks/bench_gemm.py benchmarks/bench_train_step.py; do
  python3 "$bench" --output "$out/BENCHMARKS-gpu.md" 2>&1 | tee -a "$out/bench.log" || status=1
done
exit $status
