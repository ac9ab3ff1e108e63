// Sparse MLA decode over the FP8 paged cache (656 B/token) for Hopper (sm_90a).
//
// Contract (flashdsa.runtime.kernels.sparse_mla_decode): for each query row (b * s_q of them) and
// head, softmax(sm_scale * q . k) over the keys its topk slot ids name, applied to the keys' first
// 512 columns; lse is the natural-log sum-exp of the scaled scores. A slot id outside
// [0, num_slots) is invalid: never read, no contribution. A row without a valid id gets out = 0,
// lse = +inf. Keys are dequantized to bf16(e4m3 * tile scale) as FlashMLA and the Triton kernel do.
//
// One CTA takes one query row, 64 heads and one split of the top-k list, in tiles of 64 keys:
//  - producer warpgroup (4 warps, few registers): per tile, each warp reads 16 slot ids, gathers
//    those tokens (16-byte loads, KEYS_IN_FLIGHT = 8 tokens per warp in flight), dequantizes the
//    latent to bf16 with its tile scale and writes the 576-wide bf16 key rows into one of two
//    shared-memory stages (zeros and a -inf score bias for invalid ids);
//  - two consumer warpgroups (8 warps): warp (r, c) owns heads 16r..16r+15; it computes the
//    scores of keys 32c..32c+31 (Q K^T over 576 columns), exchanges row maxima with its partner
//    warp (r, 1-c) through shared memory, writes its probabilities P (bf16) to shared memory and
//    accumulates P V over all 64 keys for value columns 256c..256c+255 (16 x 256 fp32 in
//    registers). Tensor cores through CuTe's SM80 atoms: ldmatrix + mma.sync m16n8k16 bf16 ->
//    fp32. Online softmax in base 2 in registers.
// Stages are handed over with named barriers (FULL: producer -> consumers, EMPTY: back).
// Shared rows are 16-byte chunks XOR-swizzled by (row & 7), so ldmatrix reads of 8 rows hit 8
// different bank groups. With splits > 1 each CTA writes an fp32 partial (out, lse) and
// combine_kernel merges the splits of a (row, head).

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "sparse_decode.h"

namespace flashdsa {
namespace {

// The 656-byte token (flashdsa.runtime.cache.layout).
constexpr int LATENT = 512;           // e4m3 values, 4 quantization tiles of 128
constexpr int QUANT_TILE = 128;
constexpr int ROPE = 64;              // bf16 values, not quantized
constexpr int D_QK = LATENT + ROPE;   // 576
constexpr int D_V = LATENT;           // 512
constexpr int TOKEN_BYTES = 656;
constexpr int SCALE_OFFSET = 512;
constexpr int ROPE_OFFSET = 528;

constexpr int HEADS = kSparseDecodeHeadsPerCta;  // query heads per CTA (one per MMA row)
constexpr int KEYS = kSparseDecodeKeysPerTile;   // keys per pipeline stage
constexpr int STAGES = 2;
constexpr int PRODUCER_WARPS = 4;
constexpr int CONSUMER_WARPS = 8;
constexpr int PRODUCER_THREADS = 32 * PRODUCER_WARPS;
constexpr int CONSUMER_THREADS = 32 * CONSUMER_WARPS;
constexpr int THREADS = PRODUCER_THREADS + CONSUMER_THREADS;
constexpr int PRODUCER_REGS = 112;  // setmaxnreg: 128 * 112 + 256 * 184 <= 65536 (ptxas spills the
                                    // producer at 96 with 8 tokens in flight)
constexpr int CONSUMER_REGS = 184;
constexpr int KEYS_PER_PRODUCER_WARP = KEYS / PRODUCER_WARPS;  // 16
constexpr int KEYS_IN_FLIGHT = 8;   // tokens a producer warp loads before converting any
constexpr int ROPE_CHUNKS = ROPE * 2 / 16;             // 8 16-byte chunks of bf16 RoPE per token
constexpr int ROPE_KEYS_PER_LOAD = 32 / ROPE_CHUNKS;   // one warp-wide load takes 4 tokens' RoPE
constexpr int ROW_BYTES = D_QK * 2; // a bf16 row of Q or K in shared memory: 72 chunks of 16 B
constexpr int P_ROW_BYTES = KEYS * 2;
constexpr int ROW_GROUPS = 4;       // consumer warps along the heads (16 rows each)
constexpr int COL_GROUPS = 2;       // consumer warps along the keys (scores) and d_v (output)
constexpr int KEYS_PER_WARP = KEYS / COL_GROUPS;   // 32: 4 MMA n-tiles of scores
constexpr int V_COLS_PER_WARP = D_V / COL_GROUPS;  // 256: 32 MMA n-tiles of output
constexpr int S_TILES = KEYS_PER_WARP / 8;
constexpr int O_TILES = V_COLS_PER_WARP / 8;
constexpr int COMBINE_THREADS = D_V / 4;
constexpr float LN2 = 0.6931471805599453f;

static_assert(ROW_GROUPS * 16 == HEADS && ROW_GROUPS * COL_GROUPS == CONSUMER_WARPS, "consumer warp grid");
static_assert(KEYS_PER_WARP % 16 == 0 && V_COLS_PER_WARP % 16 == 0 && D_QK % 16 == 0 && KEYS % 16 == 0,
              "MMA tiles: m16n8k16 with B loaded two n-tiles at a time");
static_assert(KEYS_PER_PRODUCER_WARP <= 16 && KEYS_PER_PRODUCER_WARP % KEYS_IN_FLIGHT == 0,
              "a producer warp's slot ids sit in lanes 0..15, taken KEYS_IN_FLIGHT at a time");
static_assert(LATENT / 16 == 32 && QUANT_TILE % 16 == 0 && 32 % ROPE_CHUNKS == 0 &&
                  KEYS_IN_FLIGHT % ROPE_KEYS_PER_LOAD == 0,
              "a producer lane takes 16 latent bytes (one chunk of one quantization tile) of each token and one "
              "RoPE chunk of every ROPE_KEYS_PER_LOAD tokens");
static_assert(TOKEN_BYTES % 16 == 0 && ROPE_OFFSET % 16 == 0 && SCALE_OFFSET % 4 == 0,
              "tokens are gathered with 16-byte loads");
static_assert((ROW_BYTES / 16) % 8 == 0 && (P_ROW_BYTES / 16) % 8 == 0,
              "the chunk swizzle permutes aligned groups of 8 chunks inside one row");
static_assert(D_V % (4 * COMBINE_THREADS) == 0 || D_V == 4 * COMBINE_THREADS, "combine: 4 columns per thread");
static_assert(PRODUCER_THREADS * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= 65536 &&
                  PRODUCER_REGS % 8 == 0 && CONSUMER_REGS % 8 == 0,
              "setmaxnreg budget");

struct Shared {
  alignas(128) uint8_t q[HEADS * ROW_BYTES];         // the CTA's 64 query rows, bf16
  alignas(128) uint8_t k[STAGES][KEYS * ROW_BYTES];  // dequantized keys; the first 512 columns are V
  alignas(128) uint8_t p[HEADS * P_ROW_BYTES];       // probabilities of the current tile, bf16
  float bias[STAGES][KEYS];                          // 0 for a valid slot id, -inf otherwise
  float row_max[COL_GROUPS][HEADS];                  // each column group's tile maxima
  float row_sum[COL_GROUPS][HEADS];                  // each column group's sums, at the end
};
static_assert(sizeof(Shared) <= 227 * 1024, "one CTA per SM: at most 227 KB of shared memory");

// Named barriers (0 is __syncthreads', unused after the role split).
constexpr int BAR_CONSUMERS = 1;
constexpr int BAR_FULL = 2;   // + stage: the producers filled it
constexpr int BAR_EMPTY = 4;  // + stage: the consumers are done with it
static_assert(BAR_EMPTY + STAGES <= 16, "16 hardware named barriers");

__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled shared buffer.
__device__ __forceinline__ int swizzle(int row, int chunk, int row_bytes) {
  return row * row_bytes + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void ldsm_x4(const uint8_t* at, uint32_t (&r)[4]) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(at), r[0], r[1], r[2], r[3]);
}

__device__ __forceinline__ void ldsm_x4_trans(const uint8_t* at, uint32_t (&r)[4]) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(at), r[0], r[1], r[2], r[3]);
}

// d += a b for one m16n8k16 tile (a: 16x16 bf16 row-major fragment, b: 16x8 col-major).
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1],
                                             d[2], d[3]);
}

// acc[n] += A B_n over one k-step of 16 for the n-tiles n = 0..N-1 of a warp's 16 rows. a_at is
// this lane's ldmatrix row address in the row-major A tile; b_at(jj) its row address for n-tiles
// 2jj and 2jj + 1 of B, stored [n][k] (keys for Q K^T) or, with TRANS_B, [k][n] (V for P V).
template <bool TRANS_B, int N, typename BAt>
__device__ __forceinline__ void warp_mma(float (&acc)[N][4], const uint8_t* a_at, BAt b_at) {
  static_assert(N % 2 == 0, "B is loaded two n-tiles at a time");
  uint32_t a[4];
  ldsm_x4(a_at, a);
#pragma unroll
  for (int jj = 0; jj < N / 2; ++jj) {
    uint32_t b[4];
    if constexpr (TRANS_B) {
      ldsm_x4_trans(b_at(jj), b);
    } else {
      ldsm_x4(b_at(jj), b);
    }
    mma(acc[2 * jj], a, b[0], b[1]);
    mma(acc[2 * jj + 1], a, b[2], b[3]);
  }
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two e4m3 values (low byte first) -> bf16x2 of value * scale, rounded once (fp32 product).
__device__ __forceinline__ uint32_t dequant_pair(uint32_t pair, float scale) {
  const __half2 h(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3));
  const float2 f = __half22float2(h);
  return pack_bf16(f.x * scale, f.y * scale);
}

// 16 e4m3 values -> two 16-byte chunks of bf16.
__device__ __forceinline__ void dequant_chunk(uint4 raw, float scale, uint4& lo, uint4& hi) {
  lo = make_uint4(dequant_pair(raw.x, scale), dequant_pair(raw.x >> 16, scale), dequant_pair(raw.y, scale),
                  dequant_pair(raw.y >> 16, scale));
  hi = make_uint4(dequant_pair(raw.z, scale), dequant_pair(raw.z >> 16, scale), dequant_pair(raw.w, scale),
                  dequant_pair(raw.w >> 16, scale));
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The CTA's work: query row, head block, split and its [start, end) of the top-k list.
struct Work {
  int64_t row;
  int head_block;
  int split;
  int start, end, tiles;
};

__device__ __forceinline__ Work work_of(const SparseDecodeArgs& a) {
  const int head_blocks = a.h_q / HEADS;
  Work w;
  w.head_block = static_cast<int>(blockIdx.x % head_blocks);
  w.split = static_cast<int>((blockIdx.x / head_blocks) % a.splits);
  w.row = static_cast<int64_t>(blockIdx.x / (head_blocks * a.splits));
  w.start = w.split * a.tokens_per_split;
  w.end = min(w.start + a.tokens_per_split, a.topk);
  w.tiles = w.end > w.start ? (w.end - w.start + KEYS - 1) / KEYS : 0;
  return w;
}

// Producer warp `warp` (0..3): keys 16 * warp .. 16 * warp + 15 of every tile.
__device__ void produce(const SparseDecodeArgs& a, const Work& w, Shared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first = warp * KEYS_PER_PRODUCER_WARP;
  const int32_t* ids = a.indices + w.row * a.topk;
  for (int t = 0; t < w.tiles; ++t) {
    const int stage = t % STAGES;
    if (t >= STAGES) bar_sync(BAR_EMPTY + stage, THREADS);
    const int pos = w.start + t * KEYS + first + (lane % KEYS_PER_PRODUCER_WARP);
    const int slot = pos < w.end ? ids[pos] : -1;
    const bool valid = slot >= 0 && slot < a.num_slots;
    if (lane < KEYS_PER_PRODUCER_WARP) s.bias[stage][first + lane] = valid ? 0.0f : -INFINITY;
    const int my_slot = valid ? slot : -1;
    uint8_t* rows = s.k[stage];
#pragma unroll 1
    for (int j0 = 0; j0 < KEYS_PER_PRODUCER_WARP; j0 += KEYS_IN_FLIGHT) {
      uint4 latent[KEYS_IN_FLIGHT], rope[KEYS_IN_FLIGHT / ROPE_KEYS_PER_LOAD];
      float scale[KEYS_IN_FLIGHT];
#pragma unroll
      for (int j = 0; j < KEYS_IN_FLIGHT; ++j) {  // all loads first: KEYS_IN_FLIGHT tokens in flight
        const int key_slot = __shfl_sync(0xffffffffu, my_slot, j0 + j);
        latent[j] = make_uint4(0, 0, 0, 0);
        scale[j] = 0.0f;
        if (key_slot >= 0) {  // warp-uniform; only valid slots are dereferenced
          const uint8_t* token = a.cache + static_cast<int64_t>(key_slot) * TOKEN_BYTES;
          latent[j] = __ldg(reinterpret_cast<const uint4*>(token) + lane);
          scale[j] = __ldg(reinterpret_cast<const float*>(token + SCALE_OFFSET) + lane * 16 / QUANT_TILE);
        }
      }
#pragma unroll
      for (int i = 0; i < KEYS_IN_FLIGHT / ROPE_KEYS_PER_LOAD; ++i) {  // lane group lane / 8 takes one key's RoPE
        const int key_slot = __shfl_sync(0xffffffffu, my_slot, j0 + ROPE_KEYS_PER_LOAD * i + lane / ROPE_CHUNKS);
        rope[i] = make_uint4(0, 0, 0, 0);
        if (key_slot >= 0) {
          const uint8_t* token = a.cache + static_cast<int64_t>(key_slot) * TOKEN_BYTES;
          rope[i] = __ldg(reinterpret_cast<const uint4*>(token + ROPE_OFFSET) + lane % ROPE_CHUNKS);
        }
      }
#pragma unroll
      for (int j = 0; j < KEYS_IN_FLIGHT; ++j) {
        const int key = first + j0 + j;
        uint4 lo, hi;
        dequant_chunk(latent[j], scale[j], lo, hi);
        *reinterpret_cast<uint4*>(rows + swizzle(key, 2 * lane, ROW_BYTES)) = lo;
        *reinterpret_cast<uint4*>(rows + swizzle(key, 2 * lane + 1, ROW_BYTES)) = hi;
      }
#pragma unroll
      for (int i = 0; i < KEYS_IN_FLIGHT / ROPE_KEYS_PER_LOAD; ++i) {
        const int key = first + j0 + ROPE_KEYS_PER_LOAD * i + lane / ROPE_CHUNKS;
        *reinterpret_cast<uint4*>(rows + swizzle(key, LATENT / 8 + lane % ROPE_CHUNKS, ROW_BYTES)) = rope[i];
      }
    }
    bar_arrive(BAR_FULL + stage, THREADS);
  }
}

// Consumer warp (r, c): heads 16r..16r+15; score keys 32c..32c+31; value columns 256c..256c+255.
__device__ void consume(const SparseDecodeArgs& a, const Work& w, Shared& s) {
  const int tid = threadIdx.x - PRODUCER_THREADS;
  const int lane = tid & 31, warp = tid >> 5;
  const int r = warp % ROW_GROUPS, c = warp / ROW_GROUPS;
  const int g = lane >> 2, t4 = lane & 3;  // MMA fragment: rows g and g + 8, columns 2 * t4 (+1)

  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q) + (w.row * a.h_q + w.head_block * HEADS) * D_QK;
  for (int i = tid; i < HEADS * D_QK / 8; i += CONSUMER_THREADS) {
    const int head = i / (D_QK / 8), chunk = i % (D_QK / 8);
    *reinterpret_cast<uint4*>(s.q + swizzle(head, chunk, ROW_BYTES)) =
        *reinterpret_cast<const uint4*>(q + static_cast<int64_t>(head) * D_QK + chunk * 8);
  }
  bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);

  float acc[O_TILES][4];
#pragma unroll
  for (int n = 0; n < O_TILES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};  // running maxima (base-2 scaled scores) of rows g, g + 8
  float l[2] = {0.0f, 0.0f};            // this warp's share of the running sums

  // Per-lane ldmatrix rows: A operands (Q, P) rows 16r + (lane & 15); B operands as below.
  const int a_row = 16 * r + (lane & 15), a_chunk = lane >> 4;
  const int k_key = KEYS_PER_WARP * c + (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
  const int v_key = (lane & 7) + (((lane >> 3) & 1) << 3), v_chunk = (V_COLS_PER_WARP / 8) * c + (lane >> 4);

  for (int t = 0; t < w.tiles; ++t) {
    const int stage = t % STAGES;
    const uint8_t* keys = s.k[stage];
    bar_sync(BAR_FULL + stage, THREADS);

    // Scores of heads 16r.. x keys 32c..: S = Q K^T over all 576 columns.
    float sc[S_TILES][4];
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll 4
    for (int kk = 0; kk < D_QK / 16; ++kk) {
      warp_mma<false>(sc, s.q + swizzle(a_row, 2 * kk + a_chunk, ROW_BYTES),
                      [&](int jj) { return keys + swizzle(k_key + 16 * jj, 2 * kk + k_chunk, ROW_BYTES); });
    }

    // Scale to base 2, mask invalid keys, and agree on the tile's row maxima with the partner warp.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = KEYS_PER_WARP * c + 8 * j + 2 * t4 + (e & 1);
        sc[j][e] = sc[j][e] * a.scale_log2 + s.bias[stage][key];
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], sc[j][e]);
      }
    }
    tile_max[0] = quad_max(tile_max[0]);
    tile_max[1] = quad_max(tile_max[1]);
    if (t4 == 0) {
      s.row_max[c][16 * r + g] = tile_max[0];
      s.row_max[c][16 * r + g + 8] = tile_max[1];
    }
    bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);
    float alpha[2], base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], fmaxf(tile_max[i], s.row_max[1 - c][16 * r + g + 8 * i]));
      base[i] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing valid yet: all weights 0
      alpha[i] = exp2_approx(m[i] - base[i]);
      m[i] = m_new;
    }
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[j][e] = exp2_approx(sc[j][e] - base[e >> 1]);
        sum[e >> 1] += sc[j][e];
      }
      // P (bf16) for rows g, g + 8 and keys 32c + 8j + 2t4 (+1): 4 bytes into 16-byte chunk 4c + j.
      const int chunk = (KEYS_PER_WARP / 8) * c + j;
      *reinterpret_cast<uint32_t*>(s.p + swizzle(16 * r + g, chunk, P_ROW_BYTES) + 4 * t4) =
          pack_bf16(sc[j][0], sc[j][1]);
      *reinterpret_cast<uint32_t*>(s.p + swizzle(16 * r + g + 8, chunk, P_ROW_BYTES) + 4 * t4) =
          pack_bf16(sc[j][2], sc[j][3]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + sum[i];
#pragma unroll
    for (int n = 0; n < O_TILES; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }
    bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);  // both halves of P are written

    // O += P V: heads 16r.. x value columns 256c.. over the tile's 64 keys.
#pragma unroll
    for (int ks = 0; ks < KEYS / 16; ++ks) {
      warp_mma<true>(acc, s.p + swizzle(a_row, 2 * ks + a_chunk, P_ROW_BYTES),
                     [&](int jj) { return keys + swizzle(16 * ks + v_key, v_chunk + 2 * jj, ROW_BYTES); });
    }
    if (t + STAGES < w.tiles) bar_arrive(BAR_EMPTY + stage, THREADS);
  }

  // Row sums over both key halves, then out = acc / sum and lse = ln(sum) + max.
  const float own[2] = {quad_sum(l[0]), quad_sum(l[1])};
  if (t4 == 0) {
    s.row_sum[c][16 * r + g] = own[0];
    s.row_sum[c][16 * r + g + 8] = own[1];
  }
  bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);
  const bool direct = a.splits == 1;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int local = 16 * r + g + 8 * i;
    const int head = w.head_block * HEADS + local;
    const float total = s.row_sum[0][local] + s.row_sum[1][local];
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const float empty_lse = direct ? INFINITY : -INFINITY;  // a partial without keys weighs 0 in the combine
    const float lse = total > 0.0f ? (m[i] + log2f(total)) * LN2 : empty_lse;
    const int col0 = V_COLS_PER_WARP * c + 2 * t4;
    if (direct) {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out) + (w.row * a.h_q + head) * D_V + col0;
#pragma unroll
      for (int n = 0; n < O_TILES; ++n)
        *reinterpret_cast<uint32_t*>(out + 8 * n) = pack_bf16(acc[n][2 * i] * inv, acc[n][2 * i + 1] * inv);
      if (c == 0 && t4 == 0) {
        const int64_t b = w.row / a.s_q, q_pos = w.row % a.s_q;
        a.lse[(b * a.h_q + head) * a.s_q + q_pos] = lse;
      }
    } else {
      const int64_t part = (w.row * a.splits + w.split) * a.h_q + head;
      float* out = a.part_out + part * D_V + col0;
#pragma unroll
      for (int n = 0; n < O_TILES; ++n)
        *reinterpret_cast<float2*>(out + 8 * n) = make_float2(acc[n][2 * i] * inv, acc[n][2 * i + 1] * inv);
      if (c == 0 && t4 == 0) a.part_lse[part] = lse;
    }
  }
}

__global__ void __launch_bounds__(THREADS, 1) decode_kernel(const __grid_constant__ SparseDecodeArgs args) {
  extern __shared__ __align__(128) uint8_t smem[];
  Shared& s = *reinterpret_cast<Shared*>(smem);
  const Work w = work_of(args);
  if (threadIdx.x < PRODUCER_THREADS) {
    cutlass::arch::warpgroup_reg_dealloc<PRODUCER_REGS>();
    produce(args, w, s);
  } else {
    cutlass::arch::warpgroup_reg_alloc<CONSUMER_REGS>();
    consume(args, w, s);
  }
}

// One CTA per (row, head): out = sum_s exp(lse_s - lse) out_s, lse = ln sum_s exp(lse_s).
__global__ void __launch_bounds__(COMBINE_THREADS) combine_kernel(const __grid_constant__ SparseDecodeArgs a) {
  const int64_t row = blockIdx.x / a.h_q;
  const int head = static_cast<int>(blockIdx.x % a.h_q);
  const float* lse_s = a.part_lse + row * a.splits * a.h_q + head;  // split s at lse_s[s * h_q]
  float top = -INFINITY;
  for (int sp = 0; sp < a.splits; ++sp) top = fmaxf(top, lse_s[sp * a.h_q]);
  const float base = top == -INFINITY ? 0.0f : top;
  float total = 0.0f;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float* part = a.part_out + (row * a.splits * a.h_q + head) * D_V + 4 * threadIdx.x;
  for (int sp = 0; sp < a.splits; ++sp) {
    const float weight = expf(lse_s[sp * a.h_q] - base);
    if (weight > 0.0f) {  // an empty split holds no keys (and must not be read as 0 * anything)
      const float4 o = *reinterpret_cast<const float4*>(part + static_cast<int64_t>(sp) * a.h_q * D_V);
      acc.x += weight * o.x;
      acc.y += weight * o.y;
      acc.z += weight * o.z;
      acc.w += weight * o.w;
      total += weight;
    }
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out) + (row * a.h_q + head) * D_V + 4 * threadIdx.x;
  *reinterpret_cast<uint2*>(out) = make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
  if (threadIdx.x == 0) {
    const int64_t b = row / a.s_q, q_pos = row % a.s_q;
    a.lse[(b * a.h_q + head) * a.s_q + q_pos] = total > 0.0f ? base + logf(total) : INFINITY;
  }
}

}  // namespace

const char* launch_sparse_decode(const SparseDecodeArgs& args, int device, void* stream) {
  if (args.rows == 0) return nullptr;
  if (args.h_q % HEADS != 0 || args.splits < 1 || args.splits > kSparseDecodeMaxSplits ||
      args.tokens_per_split % KEYS != 0 || args.topk < 1 || args.topk > kSparseDecodeMaxTopk)
    return "sparse decode: unsupported h_q, splits, tokens_per_split or topk (the op checks these first)";
  const int64_t ctas = args.rows * (args.h_q / HEADS) * args.splits;
  if (ctas > 0x7fffffff) return "sparse decode: more than 2^31 - 1 CTAs";
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const int bytes = sizeof(Shared);
  err = cudaFuncSetAttribute(decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) {
    decode_kernel<<<static_cast<unsigned>(ctas), THREADS, bytes, cuda_stream>>>(args);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess && args.splits > 1) {
    combine_kernel<<<static_cast<unsigned>(args.rows * args.h_q), COMBINE_THREADS, 0, cuda_stream>>>(args);
    err = cudaGetLastError();
  }
  if (previous != device) cudaSetDevice(previous);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace flashdsa
