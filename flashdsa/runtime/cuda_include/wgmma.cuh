// wgmma helpers shared by the native kernels (sm_90a): shared-memory descriptors for the 128-byte
// swizzle, the async-proxy fence, and calls of CuTe's wgmma atoms over accumulators held as
// N / 8 fragments of 4 floats (the m64nN layout: fragment i holds columns 8i.. of rows lane / 4
// and lane / 4 + 8 of the warp's 16).
#pragma once

#include <cstdint>
#include <utility>
#include <cute/arch/mma_sm90_gmma.hpp>

namespace flashdsa {

namespace gmma = cute::SM90::GMMA;

// Makes this thread's shared-memory stores visible to wgmma (the async proxy); the barrier after
// it hands them over. (CUTLASS's fence_view_async_shared has no memory clobber, so the compiler
// could move the stores past it.)
__device__ __forceinline__ void fence_to_wgmma() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Byte offset of 16-byte chunk `chunk` (< 8) of 128-byte row `row` in the 128-byte-swizzle layout
// (rows of a 1024-byte-aligned block, their chunks XOR-swizzled by row & 7).
__device__ __forceinline__ int swizzle_128b(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// wgmma shared-memory descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (K-major operands: stride = 1024 between 8-row groups, leading unused; MN-major: leading
// = the stride between 64-column blocks, stride = 1024 between 8-row groups along K).
__device__ __forceinline__ uint64_t sw128_desc(const void* start, uint32_t leading, uint32_t stride) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(start));
  return static_cast<uint64_t>((addr & 0x3ffff) >> 4) | static_cast<uint64_t>(leading >> 4) << 16 |
         static_cast<uint64_t>(stride >> 4) << 32 | uint64_t{1} << 62;
}

// d += A B for one wgmma `Mma` whose accumulator is fragments FIRST.. of d (sizeof...(I) / 4 of them,
// 4 floats each; all of d by default).
template <typename Mma, int FIRST = 0, int N, size_t... I>
__device__ __forceinline__ void wgmma_fragments(uint64_t a, uint64_t b, float (&d)[N][4], gmma::ScaleOut scale_d,
                                                std::index_sequence<I...>) {
  static_assert(FIRST + sizeof...(I) / 4 <= N, "the accumulator's fragments lie inside d");
  Mma::fma(a, b, d[FIRST + I / 4][I % 4]..., scale_d);
}

// scale_d Zero: d = A B (d's old values are not read).
template <typename Mma, int N>
__device__ __forceinline__ void wgmma(uint64_t a, uint64_t b, float (&d)[N][4],
                                      gmma::ScaleOut scale_d = gmma::ScaleOut::One) {
  wgmma_fragments<Mma>(a, b, d, scale_d, std::make_index_sequence<4 * N>{});
}

// d += A B for one register-A wgmma `Mma`: a holds the thread's A fragment (4 x bf16x2).
template <typename Mma, int N, size_t... I>
__device__ __forceinline__ void wgmma_rs_fragments(const uint32_t (&a)[4], uint64_t b, float (&d)[N][4],
                                                   std::index_sequence<I...>) {
  Mma::fma(a[0], a[1], a[2], a[3], b, d[I / 4][I % 4]...);
}

template <typename Mma, int N>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t b, float (&d)[N][4]) {
  wgmma_rs_fragments<Mma>(a, b, d, std::make_index_sequence<4 * N>{});
}

// The sum over the four lanes that hold one accumulator row (a quad: lanes 4r..4r+3).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int N>
__device__ __forceinline__ void fence_fragments(float (&d)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(d[n][e]);
}

}  // namespace flashdsa
