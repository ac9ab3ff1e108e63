#!/usr/bin/env bash
# One GPU call for the V4 decode-step host work (branch v4host): the GPU tests that cover the V4
# decode step as the engine runs it (sync-free forward and its CUDA-graph replay against eager, the
# fused mHC / compressor decode step by step, async scheduling with graphs, graph padding rows as
# the batch shrinks, the V4 engine), then the V4-Flash-width end-to-end decode benchmark. Writes at
# most 4 files under $OUT (default /tmp/flashdsa-gpu): device.txt, tests.log, e2e-v4.log,
# BENCHMARKS-e2e.md. About 5-7 minutes on an H100. Run on the device machine as:
#   bash scripts/gpu_v4host.sh
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
status=0
timeout 330 python3 -m pytest -q -rfEs \
  "tests/models/test_deepseek_v4_gpu.py::test_decode_step_is_sync_free_and_replays_as_a_graph" \
  "tests/models/test_deepseek_v4_gpu.py::test_fused_mhc_and_compressor_decode_match_the_torch_path_step_by_step" \
  tests/models/test_async_scheduling_gpu.py tests/models/test_decode_graphs_gpu.py tests/serve/test_engine_v4.py \
  2>&1 | tee "$out/tests.log" || status=1
timeout 200 python3 -m benchmarks.bench_e2e --arch deepseek_v4 --points 1x4096,32x4096 --steps 16 \
  --output "$out/BENCHMARKS-e2e.md" 2>&1 | tail -n 40 | tee "$out/e2e-v4.log" || status=1
exit $status
