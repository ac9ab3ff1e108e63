#!/usr/bin/env bash
# One GPU call for the one-launch decode linear (fp8_linear at M <= 64: activation quantization
# in the GEMM, split K summed by the last split through per-tile tickets): its GPU tests (200
# back-to-back random split-K launches bit-equal to quantize + fp8_gemm, a CUDA graph replayed on
# new inputs, the sync-free graph-captured fp8_linear, the quantizer's bytes), then bench_gemm's
# comparison of the two Triton steps against the one launch at V3.2's decode shapes (M = 1, 4, 32,
# both from CUDA graphs). About 3 minutes on an H100; two logs under $OUT (default /tmp/flashdsa-gpu).
# The full GEMM regression (every shape, every swept config, compute-sanitizer) is scripts/gpu_gemm.sh.
# Run on the device machine as:  bash scripts/gpu_gemmquant.sh
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout 200 python3 -m pytest -q -m gpu -rfE tests/gemm/test_triton_fp8_gemm.py \
    -k "one_launch or fp8_linear or quantizer"
} 2>&1 | tee "$out/gemmquant-tests.log" || status=1
timeout 200 python3 benchmarks/bench_gemm.py --one-launch 2>&1 | tee "$out/gemmquant-bench.log" || status=1
exit $status
