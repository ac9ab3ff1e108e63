#!/usr/bin/env bash
# One GPU call for what session 5 built without a GPU: DeepSeek-V4 in the engine (production
# mode on Triton kernels: check, sync-free decode step, CUDA-graph replay), the V4 MoE fast path,
# async scheduling (token equality with CUDA graphs, one wait a step), then the decode benchmarks
# (V3.2 sync vs async; V4-Flash width). Writes at most 6 files under $OUT (default
# /tmp/flashdsa-gpu): device.txt, tests.log, e2e-v32.log, e2e-v4.log, BENCHMARKS-e2e.md, v4cache.md.
# Run on the device machine as:  bash scripts/gpu_v4.sh   (BENCH=0 skips the benchmarks)
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
status=0
python3 -m pytest -q -rfEs tests/models/test_deepseek_v4_gpu.py tests/models/test_async_scheduling_gpu.py \
  tests/models/test_deepseek_v4_paged.py tests/serve/test_engine_v4.py tests/kernels/test_triton_v4.py \
  tests/moe/test_hash_routing.py tests/moe/test_swiglu.py tests/moe/test_routing.py tests/hyper/test_hyper.py \
  tests/compressor/test_triton_decode_step.py tests/moe/test_cuda_fp4_moe.py tests/gemm/test_cuda_gemv.py \
  tests/serve/test_argmax.py \
  $(ls tests/models/test_deepseek_v4_moe*.py 2>/dev/null) 2>&1 | tee "$out/tests.log" || status=1
if [ "${BENCH:-1}" = 1 ]; then
  python3 -m benchmarks.bench_e2e --async-scheduling both --points 1x4096,32x4096,128x2048 --prefill "" \
    --output "$out/BENCHMARKS-e2e.md" 2>&1 | tail -n 40 | tee "$out/e2e-v32.log" || status=1
  python3 -m benchmarks.bench_e2e --arch deepseek_v4 --points 1x4096,32x4096 --steps 16 \
    --output "$out/BENCHMARKS-e2e.md" 2>&1 | tail -n 40 | tee "$out/e2e-v4.log" || status=1
  python3 -m benchmarks.bench_v4_cache > "$out/v4cache.md" 2>&1 || status=1
fi
exit $status
