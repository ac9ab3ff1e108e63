#!/usr/bin/env bash
# One GPU call for the native (CUDA C++) kernels: build them (timed: the first use's JIT cost; the
# ptxas report gives registers, spills and shared memory per kernel), their GPU tests against the
# reference, compute-sanitizer memcheck passes over edge cases (top-k, paged indexer logits, sparse
# decode, forward and backward), synccheck on the decode and the attention tests (warp roles meet at
# named barriers) and racecheck on the top-k, then the sparse
# decode and prefill benchmarks (triton, cuda and FlashMLA side by side), the top-k benchmark and the
# backward (bench_attention at 64K: Triton's and the native one). FlashMLA
# builds in the background meanwhile (from .device/flashmla: run ../shared/device/prepare first and
# carry .device). Writes at most 9 files under $OUT (default /tmp/flashdsa-gpu): device.txt,
# build.log, tests.log, memcheck.log, bench-decode.log, bench-prefill.log, bench-topk.log,
# bench-attention.log, BENCHMARKS-native.md.
# Run on the device machine (Hopper) as:  source .device/env.sh; bash scripts/gpu_native.sh
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
mkdir -p "$out"
export FLASHDSA_CACHE_DIR=${FLASHDSA_CACHE_DIR:-/tmp/flashdsa-kernels}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
{ nvcc --version | tail -n 2; python3 -c 'import torch; print("torch", torch.__version__)'; } | tee -a "$out/device.txt"
flashmla_build=""
if [ -d .device/flashmla ]; then  # ~100 s of compiling, cached in /tmp/fmla for the benchmark below
  python3 -c 'import sys; sys.path.insert(0, ".device/flashmla"); from build import flash_mla; flash_mla()' \
    > "$out/flashmla-build.tmp" 2>&1 &
  flashmla_build=$!
fi
status=0
{ time python3 -m flashdsa.cli build-kernels --compile-only && time python3 -m flashdsa.cli build-kernels; } \
  2>&1 | tee "$out/build.log" || status=1
python3 -m pytest -q -rfEs tests/native tests/indexer/test_cuda_topk.py tests/indexer/test_cuda_paged_logits.py \
  tests/kernels/test_cuda_sparse_decode.py \
  tests/moe/test_cuda_fp4_moe.py tests/gemm/test_cuda_gemv.py 2>&1 | tee "$out/tests.log" || status=1
python3 -m pytest -q -rfEs tests/kernels/test_triton_attention.py -k cuda 2>&1 | tee -a "$out/tests.log" || status=1  # the native forward
if command -v compute-sanitizer >/dev/null; then
  for t in tests/indexer/test_cuda_topk.py tests/indexer/test_cuda_paged_logits.py tests/kernels/test_cuda_sparse_decode.py \
           tests/moe/test_cuda_fp4_moe.py tests/gemm/test_cuda_gemv.py tests/kernels/test_triton_attention.py; do
    echo "== $t" >> "$out/memcheck.log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
      python3 "$t" --memcheck 2>&1 | tail -n 20 | tee -a "$out/memcheck.log" || status=1
  done
  for t in tests/kernels/test_cuda_sparse_decode.py tests/kernels/test_triton_attention.py; do  # named barriers
    echo "== synccheck $t" >> "$out/memcheck.log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool synccheck --error-exitcode 1 \
      python3 "$t" --memcheck 2>&1 | tail -n 20 | tee -a "$out/memcheck.log" || status=1
  done
  echo "== racecheck tests/indexer/test_cuda_topk.py" >> "$out/memcheck.log"
  compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/indexer/test_cuda_topk.py --memcheck \
    2>&1 | tail -n 20 | tee -a "$out/memcheck.log" || status=1
fi
if [ -n "$flashmla_build" ]; then
  wait "$flashmla_build" || { echo "FlashMLA build failed:"; tail -n 20 "$out/flashmla-build.tmp"; }
  rm -f "$out/flashmla-build.tmp"
fi
python3 -m benchmarks.bench_sparse_decode --output "$out/BENCHMARKS-native.md" 2>&1 \
  | tee "$out/bench-decode.log" || status=1
python3 -m benchmarks.bench_sparse_prefill --output "$out/BENCHMARKS-native.md" 2>&1 \
  | tee "$out/bench-prefill.log" || status=1
python3 -m benchmarks.bench_topk --output "$out/BENCHMARKS-native.md" 2>&1 | tee "$out/bench-topk.log" || status=1
python3 -m benchmarks.bench_attention --s-kv 65536 --output "$out/BENCHMARKS-native.md" 2>&1 \
  | tee "$out/bench-attention.log" || status=1  # the native backward beside Triton's
exit $status
