// Routed experts with FP4 (MXFP4) weights at decode sizes on Hopper: the two grouped GEMMs of
// fused_moe with e4m3 activations (W4A8, as DeepGEMM's and SGLang's Hopper FP8 x FP4 paths do).
//
// Contract (flashdsa.runtime.moe.cuda.fused_moe): weights are packed e2m1 pairs [E, N, K/2] (value
// 2j in the low nibble of byte j) with one UE8M0 exponent byte per row and 32 inputs [E, N, K/32];
// activations are e4m3 with fp32 scales per row and AGROUP inputs. Rows come in 16-row blocks of
// one expert (runtime.moe.alignment: each block's pairs first, then -1 padding).
//  - gate_up: for each block row r (pair p >= 0, token p / top_k) and intermediate column c,
//    h = silu(min(g, L)) * clamp(u, -L, L) (unclipped without L) with g, u the dot products of the
//    token's activations with weight rows c and I + c; h is written as e4m3 with one fp32 scale
//    (amax / 448, amax at least 1e-4) per row and 32 columns, at the block row (padding rows are
//    not written).
//  - down: out[p, c] = bf16(route_weight[p] * dot(h[block row], weight row c)) for every pair
//    p >= 0 of the block (other rows of out are not written).
//
// A CTA is one warpgroup on one block and 64 weight rows (gate_up: 32 gate rows and their 32 up
// rows); a warp streams its 16 rows over all of K with wgmma m64n8k32 / m64n16k32 e4m3 (weight rows
// as the MMA's M, the block's tokens as N: 8, or 16 when the block holds more than 8 pairs).
// Per 128 inputs a thread loads 16 bytes of each of its two rows (its quad holds 4 scale groups of
// 32 inputs, one each), a 4x4 transpose inside the quad (two xor-shuffle stages) gives each thread
// its words of every group, and bit operations turn each e2m1 nibble into the e4m3 byte of
// value/64 exactly (sign to bit 7, the 2 exponent and 1 mantissa bits to bits 4..2: the e2m1
// subnormal 0.5 lands on e4m3's subnormal grid), the even inputs into one register and the odd
// ones into another: the A operand (registers), in an MMA K order that the activations staged in
// shared memory (B, PIECE inputs at a time, split into even and odd bytes the same way) follow.
// (e4m3 mma.sync has no SM90 instruction: ptxas runs it as f16 HMMA with conversions, twice as
// many instructions.) One MMA covers one scale group, so its fp32 result is scaled by the weight
// row's 2^(e - 127) and the token's activation scale as it is accumulated (and the sum by 64).
// Loads of the next PREFETCH 128-input chunks are in flight while one is computed; weights bypass
// L1.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fp4_moe.h"
#include "stream_load.cuh"

namespace flashdsa {
namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int BLOCK_M = kFp4MoeBlockM;  // block rows (pairs) of one expert
constexpr int ROWS_PER_WARP = 16;    // weight rows per warp: the MMA's M
constexpr int CHUNK = kFp4MoeChunk;  // inputs per chunk: 4 scale groups, 64 weight bytes a row
constexpr int PREFETCH = 2;          // chunks in flight per warp
constexpr int PIECE = 2048;          // inputs of the block's activations staged in shared memory at a time
constexpr int TILE_COLS = WARPS * ROWS_PER_WARP;  // output columns staged per CTA (gate_up: 32 + 32)
constexpr unsigned FULL = 0xffffffffu;
static_assert(TILE_COLS == kFp4MoeDownColumns && TILE_COLS / 2 == kFp4MoeGateUpColumns, "fp4_moe.h's tiles");

struct Args : Fp4MoeArgs {
  int tiles;  // column tiles of a block: the grid is blocks x tiles
};

// Thread t of a quad holds words M[t][0..3] (group t's bytes 4i..4i+3); afterwards it holds
// M[0..3][t] (every group's bytes 4t..4t+3).
__device__ __forceinline__ void transpose_quad(uint32_t (&m)[4], int t) {
  const bool odd = t & 1;
  uint32_t x0 = odd ? m[0] : m[1], x1 = odd ? m[2] : m[3];
  uint32_t y0 = __shfl_xor_sync(FULL, x0, 1), y1 = __shfl_xor_sync(FULL, x1, 1);
  if (odd) { m[0] = y0; m[2] = y1; } else { m[1] = y0; m[3] = y1; }
  const bool high = t & 2;
  x0 = high ? m[0] : m[2];
  x1 = high ? m[1] : m[3];
  y0 = __shfl_xor_sync(FULL, x0, 2);
  y1 = __shfl_xor_sync(FULL, x1, 2);
  if (high) { m[0] = y0; m[1] = y1; } else { m[2] = y0; m[3] = y1; }
}

// 8 e2m1 nibbles -> the e4m3 bytes of value / 64: the low nibbles (even inputs) and the high ones.
__device__ __forceinline__ void e2m1_to_e4m3(uint32_t w, uint32_t& even, uint32_t& odd) {
  even = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
  odd = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

// UE8M0 byte `group` of `word` -> 2^(e - 127) (the 64 that e2m1_to_e4m3 divided out is put back
// once, in the epilogue).
__device__ __forceinline__ float weight_scale(uint32_t word, int group) {
  return __uint_as_float(__byte_perm(word, 0, 0x4440 + group) << 23);
}

// One warpgroup MMA over 32 inputs: d[64 rows, N tokens] = A (this thread's e4m3 registers, the
// m16n8k32 fragment of its warp's 16 rows) x B (N token rows of e4m3 in shared memory, K-major,
// no swizzle: 8-row core matrices of 16 bytes, the 16-byte K halves LBO apart, row groups SBO apart).
template <int N>
__device__ __forceinline__ void wgmma_e4m3(const uint32_t (&a)[4], uint64_t desc, float (&d)[N / 2]) {
  if constexpr (N == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(0));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(0));
  }
}

// Keep a register's value where the compiler sees it used, after an asynchronous MMA read or wrote it.
__device__ __forceinline__ void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Shared-memory matrix descriptor (no swizzle): start, LBO and SBO in 16-byte units.
__device__ __forceinline__ uint64_t smem_descriptor(const void* start, uint32_t lbo, uint32_t sbo) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(start));
  return uint64_t((address >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32);
}

// The activation row a block row reads (-1: a padding pair, zeros).
__device__ __forceinline__ int activation_row(int pair, int row, bool gated, int top_k) {
  return pair < 0 ? -1 : gated ? pair / top_k : row;
}

// Shared-memory layout of a staged piece of the block's 16 activation rows: the MMA's K order puts
// each 32-input group's even inputs in one 16-byte slab and its odd ones in the next (matching
// e2m1_to_e4m3's registers); a slab holds 16 rows of 16 bytes (two 8-row core matrices).
constexpr int SLAB = BLOCK_M * 16;

// Stage inputs [k0, k0 + width) of the block's first ROWS rows into `act`, padding rows as zeros.
template <bool GATED, int ROWS>
__device__ void stage_activations(const Args& args, const int* pairs, int block, int k0, int width, uint8_t* act) {
  const int per_row = width / 16;  // 16-byte units a row
  for (int u = threadIdx.x; u < ROWS * per_row; u += THREADS) {
    const int n = u / per_row, m = u % per_row;
    const int row = activation_row(pairs[n], block * BLOCK_M + n, GATED, args.top_k);
    uint4 x = make_uint4(0, 0, 0, 0);
    if (row >= 0) x = __ldg(reinterpret_cast<const uint4*>(args.a + int64_t(row) * args.stride_a + k0 + 16 * m));
    // unit m holds threads 2(m%2) and 2(m%2)+1 of group m/2: 8 inputs each
    uint8_t* slab = act + (m / 2) * 2 * SLAB + n * 16 + 8 * (m % 2);
    *reinterpret_cast<uint2*>(slab) = make_uint2(__byte_perm(x.x, x.y, 0x6420), __byte_perm(x.z, x.w, 0x6420));
    *reinterpret_cast<uint2*>(slab + SLAB) = make_uint2(__byte_perm(x.x, x.y, 0x7531), __byte_perm(x.z, x.w, 0x7531));
  }
}

// Stream this warp's 16 weight rows over all of K into acc (N tokens: 8, or 16 for a block of
// more than 8 pairs), staging the activations piece by piece.
template <bool GATED, int AGROUP, int N>
__device__ void stream_rows(const Args& args, const int* pairs, int block, int row0, uint8_t* act,
                            float (&acc)[N / 2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int expert = args.block_experts[block];
  const uint8_t* w_lo = args.w + expert * args.stride_w_expert + (row0 + g) * args.stride_w_row + 16 * t;
  const uint8_t* w_hi = w_lo + 8 * args.stride_w_row;
  const uint32_t* s_lo = reinterpret_cast<const uint32_t*>(args.w_scale + expert * args.stride_s_expert +
                                                          (row0 + g) * args.stride_s_row);
  const uint32_t* s_hi = s_lo + 2 * args.stride_s_row;  // 8 rows on, in 4-byte words
  // activation scale rows of this thread's C columns (tokens 8 j + 2 t and + 1); a padding row's B
  // operand is zero, so it reads the block's first row, which is always a written pair
  int as_row[N / 8][2];  // element offsets into a_scale (the op keeps it under 2^31 elements)
  const int first = activation_row(pairs[0], block * BLOCK_M, GATED, args.top_k);
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = 8 * j + 2 * t + i, row = activation_row(pairs[r], block * BLOCK_M + r, GATED, args.top_k);
      as_row[j][i] = (row < 0 ? first : row) * int(args.stride_a_scale);
    }
  const uint64_t act_desc = smem_descriptor(act, SLAB, 8 * 16);
  const int chunks = args.k / CHUNK, piece_chunks = PIECE / CHUNK;
  uint4 wl[PREFETCH], wh[PREFETCH];
  uint32_t sl[PREFETCH], sh[PREFETCH];
#pragma unroll
  for (int p = 0; p < PREFETCH; ++p) {
    if (p < chunks) {
      wl[p] = load_stream(w_lo + p * (CHUNK / 2));
      wh[p] = load_stream(w_hi + p * (CHUNK / 2));
      sl[p] = __ldg(s_lo + p);
      sh[p] = __ldg(s_hi + p);
    }
  }
  for (int c0 = 0; c0 < chunks; c0 += PREFETCH) {
#pragma unroll
    for (int p = 0; p < PREFETCH; ++p) {
      const int c = c0 + p;
      if (c >= chunks) break;
      if (c % piece_chunks == 0) {  // the next piece of activations: every warp is done with the last
        __syncthreads();
        stage_activations<GATED, N>(args, pairs, block, c * CHUNK, min(PIECE, args.k - c * CHUNK), act);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
      }
      uint32_t lo[4] = {wl[p].x, wl[p].y, wl[p].z, wl[p].w}, hi[4] = {wh[p].x, wh[p].y, wh[p].z, wh[p].w};
      const uint32_t scale_lo = sl[p], scale_hi = sh[p];
      if (c + PREFETCH < chunks) {
        wl[p] = load_stream(w_lo + (c + PREFETCH) * (CHUNK / 2));
        wh[p] = load_stream(w_hi + (c + PREFETCH) * (CHUNK / 2));
        sl[p] = __ldg(s_lo + c + PREFETCH);
        sh[p] = __ldg(s_hi + c + PREFETCH);
      }
      transpose_quad(lo, t);
      transpose_quad(hi, t);
      uint32_t a[CHUNK / 32][4];
      float d[CHUNK / 32][N / 2], scale[CHUNK / 32][N / 8][4];  // scale: each C value's weight x activation scale
#pragma unroll
      for (int q = 0; q < CHUNK / 32; ++q) {
        e2m1_to_e4m3(lo[q], a[q][0], a[q][2]);
        e2m1_to_e4m3(hi[q], a[q][1], a[q][3]);
        const float ws_lo = weight_scale(scale_lo, q), ws_hi = weight_scale(scale_hi, q);
        const int group = (c * CHUNK + q * 32) / AGROUP;
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float as = __ldg(args.a_scale + as_row[j][i] + group);
            scale[q][j][i] = ws_lo * as;
            scale[q][j][2 + i] = ws_hi * as;
          }
      }
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      const uint64_t chunk_desc = act_desc + (((c % piece_chunks) * (CHUNK / 16) * SLAB) >> 4);
#pragma unroll
      for (int q = 0; q < CHUNK / 32; ++q) {  // two commit groups: the first half's sums overlap the second's MMAs
        wgmma_e4m3<N>(a[q], chunk_desc + ((2 * q * SLAB) >> 4), d[q]);
        if (q % 2 == 1) asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (half == 0) {
          asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        } else {
          asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        }
#pragma unroll
        for (int q = 2 * half; q < 2 * half + 2; ++q) {
#pragma unroll
          for (int i = 0; i < 4; ++i) fence_operand(a[q][i]);
#pragma unroll
          for (int i = 0; i < N / 2; ++i) fence_operand(d[q][i]);
#pragma unroll
          for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[4 * j + i] = fmaf(d[q][4 * j + i], scale[q][j][i], acc[4 * j + i]);
        }
      }
    }
  }
}

// down: 3 CTAs an SM, not 4: at 128 registers nvcc 13.0's ptxas spills it (13.5's does not), and
// a decode grid (6 blocks x 64 tiles) fits in 3 a SM anyway.
template <bool GATED, int AGROUP>
__global__ void __launch_bounds__(THREADS, GATED ? 4 : 3) fp4_moe_kernel(const Args args) {
  extern __shared__ __align__(128) uint8_t act[];  // a piece of the block's activations, PIECE inputs
  __shared__ float tile[BLOCK_M][TILE_COLS + 1];
  const int block = blockIdx.x / args.tiles, tile_n = blockIdx.x % args.tiles;
  if (args.block_experts[block] < 0) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int* pairs = args.sorted_pairs + block * BLOCK_M;
  // this warp's first weight row: gate_up warps 0-1 gate rows, 2-3 the matching up rows
  const int row0 = GATED ? (warp / 2) * args.inter + tile_n * (TILE_COLS / 2) + (warp % 2) * ROWS_PER_WARP
                         : tile_n * TILE_COLS + warp * ROWS_PER_WARP;
  float acc[8] = {};
  if (pairs[8] >= 0) {  // a block's pairs come first, so rows 8.. are used iff row 8 is
    stream_rows<GATED, AGROUP, 16>(args, pairs, block, row0, act, acc);
  } else {
    float acc8[4] = {};
    stream_rows<GATED, AGROUP, 8>(args, pairs, block, row0, act, acc8);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = acc8[i];
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] *= 64.f;  // e2m1_to_e4m3's values are the weights / 64
  // stage the CTA's [16 rows, 64 columns] in shared memory for coalesced stores
  const int col = warp * ROWS_PER_WARP + g;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    tile[8 * j + 2 * t][col] = acc[4 * j + 0];
    tile[8 * j + 2 * t + 1][col] = acc[4 * j + 1];
    tile[8 * j + 2 * t][col + 8] = acc[4 * j + 2];
    tile[8 * j + 2 * t + 1][col + 8] = acc[4 * j + 3];
  }
  __syncthreads();
  const int r = threadIdx.x / 8, part = threadIdx.x % 8;  // 8 threads a block row
  const int pair = pairs[r];
  if constexpr (GATED) {  // 32 columns a row: 4 a thread, then one scale per row
    constexpr int PER = TILE_COLS / 2 / 8;
    float v[PER], amax = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      float gate = tile[r][part * PER + i], up = tile[r][TILE_COLS / 2 + part * PER + i];
      if (args.limit > 0.f) {
        gate = fminf(gate, args.limit);
        up = fminf(fmaxf(up, -args.limit), args.limit);
      }
      v[i] = gate / (1.f + __expf(-gate)) * up;
      amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int m = 1; m < 8; m *= 2) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, m));
    if (pair < 0) return;
    const float scale = fmaxf(amax, 1e-4f) / 448.f;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const __nv_fp8_e4m3 q(v[i] / scale);
      packed |= uint32_t(q.__x) << (8 * i);
    }
    const int64_t row = int64_t(block) * BLOCK_M + r;
    const int c = tile_n * (TILE_COLS / 2) + part * PER;
    *reinterpret_cast<uint32_t*>(args.h + row * args.stride_h + c) = packed;
    if (part == 0) args.h_scale[row * args.stride_h_scale + c / 32] = scale;
  } else {  // 64 columns a row: 8 bf16 a thread, scaled by the pair's routing weight
    if (pair < 0) return;
    constexpr int PER = TILE_COLS / 8;
    const float weight = args.route_weights[pair];
    __align__(16) __nv_bfloat16 v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] = __float2bfloat16(tile[r][part * PER + i] * weight);
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(args.out) + int64_t(pair) * args.stride_out +
                              tile_n * TILE_COLS + part * PER) =
        *reinterpret_cast<const uint4*>(v);
  }
}

}  // namespace

const char* launch_fp4_moe(const Fp4MoeArgs& base, bool gated, void* stream) {
  if (base.blocks == 0) return nullptr;
  Args args;
  static_cast<Fp4MoeArgs&>(args) = base;
  args.tiles = base.n / (gated ? TILE_COLS / 2 : TILE_COLS);
  const dim3 grid(base.blocks * args.tiles);
  const size_t smem = size_t(BLOCK_M) * (base.k < PIECE ? base.k : PIECE);
  const auto s = static_cast<cudaStream_t>(stream);
  if (gated) {
    fp4_moe_kernel<true, 128><<<grid, THREADS, smem, s>>>(args);
  } else {
    fp4_moe_kernel<false, 32><<<grid, THREADS, smem, s>>>(args);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace flashdsa
