// cp.async helpers shared by the native kernels (sm_80 and later): 16-byte copies from global to
// shared memory without registers, committed and waited for in groups.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace flashdsa {

// 16 bytes from global `src` to shared `dst` (cp.async; commit and wait apart); with valid false
// nothing is read and dst gets zeros.
__device__ __forceinline__ void copy_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// Closes the thread's group of copies issued since the last commit.
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most PENDING of the thread's committed groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

}  // namespace flashdsa
