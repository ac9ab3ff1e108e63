// Device helpers every native extension may include (flashdsa.runtime.native puts this folder on
// the include path and keys each build on its headers).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace flashdsa {

// 16 bytes of a tensor read once per kernel (streamed weights): no L1 allocation, a 256-byte L2
// prefetch, through the read-only path.
__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

}  // namespace flashdsa
