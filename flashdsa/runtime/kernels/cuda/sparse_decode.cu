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
//  - two consumer warpgroups (8 warps) on wgmma: warpgroup c computes the scores of all 64 heads
//    against keys 32c..32c+31 (S = Q K^T over 576 columns, m64n32k16, both operands in shared
//    memory), exchanges row maxima with the other warpgroup through shared memory, writes its
//    probabilities P (bf16) to shared memory and accumulates P V for value columns
//    256c..256c+255 over all 64 keys (m64n256k16, V read in place from the key rows, MN-major;
//    64 x 256 fp32 in registers). Online softmax in base 2 in registers.
// Stages are handed over with named barriers (FULL: producer -> consumers, EMPTY: back).
// Q, the key rows and P sit in shared memory in wgmma's 128-byte-swizzle layout: 64-column blocks
// of 128-byte rows, the 16-byte chunks of a row XOR-swizzled by (row & 7), every block 1024-byte
// aligned. Writes to them are fenced to the async proxy before the barrier that hands them over.
// With splits > 1 each CTA writes an fp32 partial (out, lse) and combine_kernel merges the splits
// of a (row, head).

#include <cstdint>
#include <utility>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cute/arch/mma_sm90_gmma.hpp>
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
constexpr int BLOCK_COLS = 64;      // bf16 columns of one 128-byte swizzle row
constexpr int BLOCK_BYTES = HEADS * BLOCK_COLS * 2;  // one column block of Q, a key tile or P: 8 KB
static_assert(HEADS == KEYS, "Q, key tiles and P share one column-block size");
constexpr int ROW_GROUPS = 4;       // consumer warps along the heads (16 rows each): a warpgroup's wgmma rows
constexpr int COL_GROUPS = 2;       // consumer warpgroups along the keys (scores) and d_v (output)
constexpr int KEYS_PER_WARP = KEYS / COL_GROUPS;   // 32: the scores' wgmma N
constexpr int V_COLS_PER_WARP = D_V / COL_GROUPS;  // 256: the output's wgmma N
constexpr int S_TILES = KEYS_PER_WARP / 8;         // accumulator fragments of 8 columns (4 floats each)
constexpr int O_TILES = V_COLS_PER_WARP / 8;
constexpr int COMBINE_THREADS = D_V / 4;
constexpr float LN2 = 0.6931471805599453f;

static_assert(ROW_GROUPS * 16 == HEADS && ROW_GROUPS * COL_GROUPS == CONSUMER_WARPS, "consumer warp grid");
static_assert(KEYS_PER_WARP == 32 && V_COLS_PER_WARP == 256 && D_QK % BLOCK_COLS == 0 && KEYS % 16 == 0 &&
                  V_COLS_PER_WARP % BLOCK_COLS == 0,
              "wgmma shapes: m64n32k16 scores, m64n256k16 output over whole column blocks");
static_assert(KEYS_PER_PRODUCER_WARP <= 16 && KEYS_PER_PRODUCER_WARP % KEYS_IN_FLIGHT == 0,
              "a producer warp's slot ids sit in lanes 0..15, taken KEYS_IN_FLIGHT at a time");
static_assert(LATENT / 16 == 32 && QUANT_TILE % 16 == 0 && 32 % ROPE_CHUNKS == 0 &&
                  KEYS_IN_FLIGHT % ROPE_KEYS_PER_LOAD == 0,
              "a producer lane takes 16 latent bytes (one chunk of one quantization tile) of each token and one "
              "RoPE chunk of every ROPE_KEYS_PER_LOAD tokens");
static_assert(TOKEN_BYTES % 16 == 0 && ROPE_OFFSET % 16 == 0 && SCALE_OFFSET % 4 == 0,
              "tokens are gathered with 16-byte loads");
static_assert(D_V % (4 * COMBINE_THREADS) == 0 || D_V == 4 * COMBINE_THREADS, "combine: 4 columns per thread");
static_assert(PRODUCER_THREADS * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= 65536 &&
                  PRODUCER_REGS % 8 == 0 && CONSUMER_REGS % 8 == 0,
              "setmaxnreg budget");

struct Shared {
  alignas(1024) uint8_t q[D_QK / BLOCK_COLS][BLOCK_BYTES];          // the CTA's 64 query rows, bf16
  alignas(1024) uint8_t k[STAGES][D_QK / BLOCK_COLS][BLOCK_BYTES];  // dequantized keys; columns < 512 are V
  alignas(1024) uint8_t p[BLOCK_BYTES];                             // probabilities of the current tile, bf16
  float bias[STAGES][KEYS];                                         // 0 for a valid slot id, -inf otherwise
  float row_max[COL_GROUPS][HEADS];                                 // each warpgroup's tile maxima
  float row_sum[COL_GROUPS][HEADS];                                 // each warpgroup's sums, at the end
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

// Makes this thread's shared-memory stores visible to wgmma (the async proxy); the barrier after
// it hands them over.
__device__ __forceinline__ void fence_to_wgmma() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Byte offset of 16-byte chunk `chunk` (8 bf16 columns) of row `row` (of 64) in a buffer of column
// blocks: block chunk / 8 holds 64 rows of 128 bytes, their chunks XOR-swizzled by (row & 7).
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return (chunk >> 3) * BLOCK_BYTES + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// wgmma shared-memory descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (K-major operands: stride = 1024 between 8-row groups, leading unused; MN-major: leading
// = the stride between 64-column blocks, stride = 1024 between 8-row groups along K).
__device__ __forceinline__ uint64_t sw128_desc(const void* start, uint32_t leading, uint32_t stride) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(start));
  return static_cast<uint64_t>((addr & 0x3ffff) >> 4) | static_cast<uint64_t>(leading >> 4) << 16 |
         static_cast<uint64_t>(stride >> 4) << 32 | uint64_t{1} << 62;
}

namespace gmma = cute::SM90::GMMA;
using ScoreMma = gmma::MMA_64x32x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
using OutputMma = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::MN>;

// d += A B for one wgmma `Mma` whose accumulator is d's N / 8 fragments of 4 floats.
template <typename Mma, int N, size_t... I>
__device__ __forceinline__ void wgmma_fragments(uint64_t a, uint64_t b, float (&d)[N][4], std::index_sequence<I...>) {
  Mma::fma(a, b, d[I / 4][I % 4]...);
}

template <typename Mma, int N>
__device__ __forceinline__ void wgmma(uint64_t a, uint64_t b, float (&d)[N][4]) {
  wgmma_fragments<Mma>(a, b, d, std::make_index_sequence<4 * N>{});
}

template <int N>
__device__ __forceinline__ void fence_fragments(float (&d)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(d[n][e]);
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
    uint8_t* rows = s.k[stage][0];
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
        *reinterpret_cast<uint4*>(rows + swizzle(key, 2 * lane)) = lo;
        *reinterpret_cast<uint4*>(rows + swizzle(key, 2 * lane + 1)) = hi;
      }
#pragma unroll
      for (int i = 0; i < KEYS_IN_FLIGHT / ROPE_KEYS_PER_LOAD; ++i) {
        const int key = first + j0 + ROPE_KEYS_PER_LOAD * i + lane / ROPE_CHUNKS;
        *reinterpret_cast<uint4*>(rows + swizzle(key, LATENT / 8 + lane % ROPE_CHUNKS)) = rope[i];
      }
    }
    fence_to_wgmma();
    bar_arrive(BAR_FULL + stage, THREADS);
  }
}

// Consumer warp r of warpgroup c: its wgmma accumulator rows are heads 16r..16r+15; the warpgroup
// scores keys 32c..32c+31 and accumulates value columns 256c..256c+255.
__device__ void consume(const SparseDecodeArgs& a, const Work& w, Shared& s) {
  const int tid = threadIdx.x - PRODUCER_THREADS;
  const int lane = tid & 31, warp = tid >> 5;
  const int r = warp % ROW_GROUPS, c = warp / ROW_GROUPS;
  const int g = lane >> 2, t4 = lane & 3;  // accumulator fragment j: rows g and g + 8, columns 8j + 2t4 (+1)

  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q) + (w.row * a.h_q + w.head_block * HEADS) * D_QK;
  for (int i = tid; i < HEADS * D_QK / 8; i += CONSUMER_THREADS) {
    const int head = i / (D_QK / 8), chunk = i % (D_QK / 8);
    *reinterpret_cast<uint4*>(s.q[0] + swizzle(head, chunk)) =
        *reinterpret_cast<const uint4*>(q + static_cast<int64_t>(head) * D_QK + chunk * 8);
  }
  fence_to_wgmma();
  bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);

  float acc[O_TILES][4];
#pragma unroll
  for (int n = 0; n < O_TILES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};  // running maxima (base-2 scaled scores) of rows g, g + 8
  float l[2] = {0.0f, 0.0f};            // this warp's share of the running sums

  // Descriptor bases: Q; warpgroup c's 32 keys of a tile (K-major); its 256 value columns (the
  // tile's column blocks 4c.., MN-major along d, K along the keys); P (K-major).
  const uint64_t q_desc = sw128_desc(s.q[0], 16, 1024);
  const uint64_t p_desc = sw128_desc(s.p, 16, 1024);

  for (int t = 0; t < w.tiles; ++t) {
    const int stage = t % STAGES;
    const uint64_t k_desc = sw128_desc(s.k[stage][0] + KEYS_PER_WARP * c * 128, 16, 1024);
    const uint64_t v_desc = sw128_desc(s.k[stage][V_COLS_PER_WARP / BLOCK_COLS * c], BLOCK_BYTES, 1024);
    bar_sync(BAR_FULL + stage, THREADS);

    // Scores of the 64 heads x keys 32c..: S = Q K^T over all 576 columns, 16 at a time (a column
    // block is 4 steps of 32 bytes; descriptors count 16-byte units).
    float sc[S_TILES][4];
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
    fence_fragments(sc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < D_QK / 16; ++kk) {
      const uint64_t step = ((kk / 4) * BLOCK_BYTES + (kk % 4) * 32) >> 4;
      wgmma<ScoreMma>(q_desc + step, k_desc + step, sc);
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_fragments(sc);

    // Scale to base 2, mask invalid keys, and agree on the tile's row maxima with the other
    // warpgroup.
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
      *reinterpret_cast<uint32_t*>(s.p + swizzle(16 * r + g, chunk) + 4 * t4) =
          pack_bf16(sc[j][0], sc[j][1]);
      *reinterpret_cast<uint32_t*>(s.p + swizzle(16 * r + g + 8, chunk) + 4 * t4) =
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
    fence_to_wgmma();
    bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);  // both halves of P are written

    // O += P V: 64 heads x value columns 256c.. over the tile's 64 keys, 16 keys (2048 bytes of
    // V rows, 32 bytes of P rows) a step.
    fence_fragments(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < KEYS / 16; ++ks) wgmma<OutputMma>(p_desc + ks * 2, v_desc + ks * 128, acc);
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_fragments(acc);
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
