#!/usr/bin/env bash
# One GPU call for the FP4 decode GEMM (fused_moe's CUDA-core path for DeepSeek-V4's packed e2m1
# routed experts at <= 2 pairs an expert): its GPU tests (V4-Flash widths against the reference and
# the grouped tensor-core path, several-row blocks, sync-free CUDA-graph replay) and the MoE tests
# it shares kernels with, the FP4 sweep (decode-GEMM candidates next to the grouped path at
# T = 1, 4, 32, 128, GB/s against the copy rate), then the V4 end-to-end decode at b=1 and b=32.
# About 4-5 minutes on an H100; logs under $OUT (default /tmp/flashdsa-gpu).
# Run on the device machine as:  bash scripts/gpu_fp4gemv.sh
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
log=$out/fp4gemv-tests.log
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$log"
timeout 90 python3 -m pytest -q -m gpu -rfE tests/moe/test_fp4_gemv.py 2>&1 | tee -a "$log" || status=1
timeout 45 python3 -m pytest -q -m gpu -rfE tests/moe/test_triton_moe.py -k "v4_clipped and fp4" 2>&1 \
  | tee -a "$log" || status=1
timeout 150 python3 benchmarks/bench_moe.py --sweep --shape v4 --dtype fp4 --output "$out/BENCHMARKS-fp4gemv.md" \
  2>&1 | tee "$out/fp4gemv-sweep.log" || status=1
timeout 90 python3 -m benchmarks.bench_e2e --arch deepseek_v4 --points 1x4096,32x4096 --steps 16 \
  2>&1 | tee "$out/fp4gemv-e2e.log" || status=1
exit $status
