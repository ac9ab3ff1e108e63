// Named-barrier helpers shared by the warp-specialized native kernels (sm_90a): barrier ids 1..15
// among a subset of a CTA's warps (id 0 is __syncthreads').
#pragma once

namespace flashdsa {

// Unaligned forms: the warps of a barrier may reach it from different role branches (different
// barrier instructions), which the aligned bar.sync forbids.
__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

}  // namespace flashdsa
