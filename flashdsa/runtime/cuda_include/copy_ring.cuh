// cp.async building blocks of the warp-specialized native kernels (sm_90a): rows into wgmma's
// 128-byte-swizzle blocks, and a producer's ring of stages handed over with mbarriers.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cutlass/arch/barrier.h>

#include "async_copy.cuh"
#include "wgmma.cuh"

namespace flashdsa {

// Rows [0, rows) x 16-byte chunks [0, chunks) of a bf16 matrix (row r at src + r * stride) into
// 64-column blocks of 128-byte swizzled rows, block b at blocks + b * block_bytes, by threads
// `thread`, `thread` + `threads`, ... (cp.async; the caller commits and waits).
__device__ __forceinline__ void copy_rows_swizzled(uint8_t* blocks, int block_bytes, const __nv_bfloat16* src,
                                                   int64_t stride, int rows, int chunks, int thread, int threads) {
  for (int i = thread; i < rows * chunks; i += threads) {
    const int row = i / chunks, chunk = i % chunks;
    copy_async_16(blocks + (chunk / 8) * block_bytes + swizzle_128b(row, chunk % 8), src + row * stride + chunk * 8,
                  true);
  }
}

// A producer warpgroup's ring of STAGES stages over `tiles` tiles: tile t waits until its stage's
// consumers have arrived on empty[t % STAGES] for tile t - STAGES, issues its copies
// (copy_tile(t, stage), cp.async), and is handed over on full[stage] once they have landed (each
// producer thread arrives after the next tile's copies are issued, so two tiles are in flight; the
// writes are fenced to the async proxy first, for wgmma).
template <int STAGES, typename CopyTile>
__device__ __forceinline__ void produce_ring(uint64_t* full, uint64_t* empty, int tiles, CopyTile&& copy_tile) {
  using Barrier = cutlass::arch::ClusterBarrier;
  for (int t = 0; t < tiles; ++t) {
    const int stage = t % STAGES;
    if (t >= STAGES) Barrier::wait(&empty[stage], ((t / STAGES) & 1) ^ 1);
    copy_tile(t, stage);
    commit_copies();
    if (t > 0) {
      wait_copies<1>();
      fence_to_wgmma();
      Barrier::arrive(&full[(t - 1) % STAGES]);
    }
  }
  if (tiles > 0) {
    wait_copies<0>();
    fence_to_wgmma();
    Barrier::arrive(&full[(tiles - 1) % STAGES]);
  }
}

}  // namespace flashdsa
