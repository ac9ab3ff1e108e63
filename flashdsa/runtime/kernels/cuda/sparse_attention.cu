// Sparse MLA attention for Hopper (sm_90a): the decode over the FP8 paged cache (656 B/token) and
// the forward (prefill, training) over bf16 key rows. One kernel body, two key sources.
//
// Contract (flashdsa.runtime.kernels.sparse_mla_decode / sparse_mla_fwd): for each query row and
// head, softmax(sm_scale * q . k) over the keys its topk ids name, applied to the keys' first 512
// columns; lse is the natural-log sum-exp of the scaled scores (max_logits their maximum). A key id
// outside [0, num_keys) is invalid: never read, no contribution. A row without a valid id gets
// out = 0, lse = +inf, max_logits = -inf. FP8 keys are dequantized to bf16(e4m3 * tile scale) as
// FlashMLA and the Triton kernel do; bf16 keys (d_qk 576 or 512) are used as they are.
//
// One CTA takes one query row, 64 heads and one split of the top-k list, in tiles of 64 keys.
// With h_q = 128 the two head blocks of a (row, split) run as a cluster of two CTAs that share
// the gather: each gathers half of every tile, and once its half is in its own shared memory it
// copies it into the peer's with the bulk copy engine (cp.async.bulk, whose bytes count on the
// peer's FULL barrier). Each key is then read from memory (and dequantized) once, not twice.
//  - producer warpgroup (4 warps, few registers), per tile: FP8 keys: each warp gathers 16 tokens
//    (8 in a pair) in batches of KEYS_IN_FLIGHT = 8 (16-byte loads; the next batch's loads are in
//    flight while one is stored, the slot ids are read a tile ahead), dequantizes the latent to
//    bf16 with its tile scale and writes the 576-wide bf16 key rows into one of two shared-memory
//    stages; bf16 keys: the warps copy their rows straight into the stage with 16-byte cp.async,
//    all of a tile's copies in flight at once. Invalid ids give zero rows and a -inf score bias;
//  - two consumer warpgroups on wgmma, split as FlashMLA's: warpgroup 0 scores all 64 heads against
//    the tile's 64 keys (S = Q K^T over d_qk columns, m64n64k16, both operands in shared memory, so
//    Q is read once a tile), runs the online softmax (base 2, in registers), writes P (bf16) and
//    the rows' rescale factors to shared memory for warpgroup 1, and accumulates P V for value
//    columns 0..255 with P from registers (m64n256k16, RS); warpgroup 1 accumulates P V for value
//    columns 256..511 with P from shared memory while warpgroup 0 scores the next tile. V is read
//    in place from the key rows (MN-major); each warpgroup holds 64 x 256 fp32 of O in registers.
// Stages are handed over with mbarriers: FULL (the CTA's producers arrive, the peer's copy counts
// its bytes) and EMPTY (every consumer warp of the pair arrives once its wgmma reads are done); P
// between the consumer warpgroups with two named barriers (written, read).
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
#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "shared_memory_opt_in.cuh"
#include "async_copy.cuh"
#include "fast_math.cuh"
#include "named_barriers.cuh"
#include "sparse_attention.h"
#include "wgmma.cuh"

namespace flashdsa {
namespace {

// The 656-byte token (flashdsa.runtime.cache.layout).
constexpr int LATENT = 512;           // e4m3 values, 4 quantization tiles of 128
constexpr int QUANT_TILE = 128;
constexpr int ROPE = 64;              // bf16 values, not quantized
constexpr int D_QK = LATENT + ROPE;   // 576, the widest key row (shared memory is sized for it)
constexpr int D_V = LATENT;           // 512
constexpr int TOKEN_BYTES = 656;
constexpr int SCALE_OFFSET = 512;
constexpr int ROPE_OFFSET = 528;

constexpr int HEADS = kSparseHeadsPerCta;  // query heads per CTA (one per MMA row)
constexpr int KEYS = kSparseKeysPerTile;   // keys per pipeline stage
constexpr int STAGES = 2;
constexpr int PRODUCER_WARPS = 4;
constexpr int CONSUMER_WARPS = 8;
constexpr int PRODUCER_THREADS = 32 * PRODUCER_WARPS;
constexpr int CONSUMER_THREADS = 32 * CONSUMER_WARPS;
constexpr int THREADS = PRODUCER_THREADS + CONSUMER_THREADS;
constexpr int WARPGROUP_THREADS = 128;
// setmaxnreg: 128 * (144 + 200 + 160) = 384 * 168, the launch's. The producer holds two batches of
// tokens; warpgroup 0 holds the scores (64 x 64 fp32) beside its half of O (ptxas, nvcc 13.0 and
// 13.5: no spills at these, spills with warpgroup 0 at 192 or warpgroup 1 at 152).
constexpr int PRODUCER_REGS = 144;
constexpr int SCORE_REGS = 200;
constexpr int VALUE_REGS = 160;
constexpr int KEYS_PER_PRODUCER_WARP = KEYS / PRODUCER_WARPS;  // 16: each warp's share of the scores' bias
constexpr int KEYS_IN_FLIGHT = 8;   // tokens a producer warp loads before converting any
constexpr int ROPE_CHUNKS = ROPE * 2 / 16;             // 8 16-byte chunks of bf16 RoPE per token
constexpr int ROPE_KEYS_PER_LOAD = 32 / ROPE_CHUNKS;   // one warp-wide load takes 4 tokens' RoPE
constexpr int BLOCK_COLS = 64;      // bf16 columns of one 128-byte swizzle row
constexpr int BLOCK_BYTES = HEADS * BLOCK_COLS * 2;  // one column block of Q, a key tile or P: 8 KB
static_assert(HEADS == KEYS, "Q, key tiles and P share one column-block size");
constexpr int ROW_GROUPS = 4;       // consumer warps along the heads (16 rows each): a warpgroup's wgmma rows
constexpr int COL_GROUPS = 2;       // consumer warpgroups along d_v (output)
constexpr int V_COLS_PER_WARP = D_V / COL_GROUPS;  // 256: the output's wgmma N
constexpr int S_TILES = KEYS / 8;                  // accumulator fragments of 8 columns (4 floats each)
constexpr int O_TILES = V_COLS_PER_WARP / 8;
constexpr int COMBINE_THREADS = D_V / 4;
constexpr float LN2 = 0.6931471805599453f;

static_assert(ROW_GROUPS * 16 == HEADS && ROW_GROUPS * COL_GROUPS == CONSUMER_WARPS, "consumer warp grid");
static_assert(KEYS == 64 && V_COLS_PER_WARP == 256 && D_QK % BLOCK_COLS == 0 && KEYS % 16 == 0 &&
                  V_COLS_PER_WARP % BLOCK_COLS == 0 && CONSUMER_THREADS == 2 * WARPGROUP_THREADS,
              "wgmma shapes: m64n64k16 scores, m64n256k16 output over whole column blocks");
static_assert(LATENT / 16 == 32 && QUANT_TILE % 16 == 0 && 32 % ROPE_CHUNKS == 0 &&
                  KEYS_IN_FLIGHT % ROPE_KEYS_PER_LOAD == 0,
              "a producer lane takes 16 latent bytes (one chunk of one quantization tile) of each token and one "
              "RoPE chunk of every ROPE_KEYS_PER_LOAD tokens");
static_assert(TOKEN_BYTES % 16 == 0 && ROPE_OFFSET % 16 == 0 && SCALE_OFFSET % 4 == 0,
              "tokens are gathered with 16-byte loads");
static_assert(D_V % (4 * COMBINE_THREADS) == 0 || D_V == 4 * COMBINE_THREADS, "combine: 4 columns per thread");
static_assert(WARPGROUP_THREADS * (PRODUCER_REGS + SCORE_REGS + VALUE_REGS) <= THREADS * 168 &&
                  PRODUCER_REGS % 8 == 0 && SCORE_REGS % 8 == 0 && VALUE_REGS % 8 == 0 &&
                  PRODUCER_THREADS == WARPGROUP_THREADS,
              "setmaxnreg budget: the registers the launch holds (168 a thread at 384 threads, one CTA an SM)");

struct Shared {
  alignas(1024) uint8_t q[D_QK / BLOCK_COLS][BLOCK_BYTES];          // the CTA's 64 query rows, bf16
  alignas(1024) uint8_t k[STAGES][D_QK / BLOCK_COLS][BLOCK_BYTES];  // dequantized keys; columns < 512 are V
  alignas(1024) uint8_t p[BLOCK_BYTES];                             // probabilities of the current tile, bf16
  float bias[STAGES][KEYS];                                         // 0 for a valid slot id, -inf otherwise
  float alpha[HEADS];                                               // the rows' rescale factors of the current tile
  float inv_sum[HEADS];                                             // 1 / the rows' sums, at the end
  uint64_t full[STAGES][2];  // the stage's keys are in place: column blocks 0..3 (values 0..255), then the rest
  uint64_t empty[STAGES];                                           // the pair's consumers are done with it
};
static_assert(sizeof(Shared) <= 227 * 1024, "one CTA per SM: at most 227 KB of shared memory");
// The bf16 output rows staged in the Q buffer at the end, each padded by 16 bytes: a fragment store
// (rows g = 0..7, 4 lanes a row) then hits 32 different banks.
constexpr int STAGED_ROW_BYTES = D_V * 2 + 16;
static_assert(HEADS * STAGED_ROW_BYTES <= sizeof(Shared::q) && STAGED_ROW_BYTES % 16 == 0, "output staging");

constexpr int PAIR_MIN_TILES = 4;  // a split of fewer tiles runs h_q 128's head blocks apart

// Named barriers (0 is __syncthreads', unused after the role split): both consumer warpgroups (Q
// loaded; the sums, then the staged output, at the end), the producers (a tile's half stored
// before it goes to the peer), and the hand-over of P between the consumer warpgroups (written;
// read).
constexpr int BAR_CONSUMERS = 1;
constexpr int BAR_PRODUCERS = 2;
constexpr int BAR_P_READY = 3;
constexpr int BAR_P_FREE = 4;
using Barrier = cutlass::arch::ClusterTransactionBarrier;

// The address of `local` (this CTA's shared memory) in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_address(const void* local, int rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(out)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(local))), "r"(rank));
  return out;
}

// Copies `bytes` of this CTA's shared memory at `local` to the same offset in CTA `rank` (the bulk
// copy engine, async proxy: fence the source's generic stores first); they count as transaction
// bytes on that CTA's copy of mbarrier `barrier`.
__device__ __forceinline__ void copy_to_peer(const void* local, int rank, uint32_t bytes, const uint64_t* barrier) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   cluster_address(local, rank)),
               "r"(static_cast<uint32_t>(__cvta_generic_to_shared(local))), "r"(bytes),
               "r"(cluster_address(barrier, rank))
               : "memory");
}

// Byte offset of 16-byte chunk `chunk` (8 bf16 columns) of row `row` (of 64) in a buffer of column
// blocks: block chunk / 8 holds 64 rows of 128 bytes, their chunks XOR-swizzled by (row & 7).
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return (chunk >> 3) * BLOCK_BYTES + swizzle_128b(row, chunk & 7);
}

using ScoreMma = gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
using LowerOutputMma = gmma::MMA_64x256x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;  // P from registers
using UpperOutputMma = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::MN>;  // P from shared memory

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

// The CTA's work: query row, head block, split and its [start, end) of the top-k list.
struct Work {
  int64_t row;
  int head_block;
  int split;
  int start, end, tiles;
};

__device__ __forceinline__ Work work_of(const SparseAttentionArgs& a) {
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

// KEYS_IN_FLIGHT tokens of one producer warp, as loaded: lane l holds bytes 16l..16l+15 of each
// token's latent (and that quantization tile's scale); lane group l / 8 holds one RoPE chunk of
// every ROPE_KEYS_PER_LOAD-th token.
struct Batch {
  uint4 latent[KEYS_IN_FLIGHT];
  float scale[KEYS_IN_FLIGHT];
  uint4 rope[KEYS_IN_FLIGHT / ROPE_KEYS_PER_LOAD];
};

// Issues the loads of tokens j0..j0 + KEYS_IN_FLIGHT - 1 of the warp, whose checked slot ids (-1:
// invalid, read as zeros) sit in lanes 0.. of `slot`.
__device__ __forceinline__ Batch load_batch(const SparseAttentionArgs& a, int slot, int j0, int lane) {
  Batch b;
#pragma unroll
  for (int j = 0; j < KEYS_IN_FLIGHT; ++j) {
    const int key_slot = __shfl_sync(0xffffffffu, slot, j0 + j);
    b.latent[j] = make_uint4(0, 0, 0, 0);
    b.scale[j] = 0.0f;
    if (key_slot >= 0) {  // warp-uniform; only valid slots are dereferenced
      const uint8_t* token = static_cast<const uint8_t*>(a.keys) + static_cast<int64_t>(key_slot) * TOKEN_BYTES;
      b.latent[j] = __ldg(reinterpret_cast<const uint4*>(token) + lane);
      b.scale[j] = __ldg(reinterpret_cast<const float*>(token + SCALE_OFFSET) + lane * 16 / QUANT_TILE);
    }
  }
#pragma unroll
  for (int i = 0; i < KEYS_IN_FLIGHT / ROPE_KEYS_PER_LOAD; ++i) {
    const int key_slot = __shfl_sync(0xffffffffu, slot, j0 + ROPE_KEYS_PER_LOAD * i + lane / ROPE_CHUNKS);
    b.rope[i] = make_uint4(0, 0, 0, 0);
    if (key_slot >= 0) {
      const uint8_t* token = static_cast<const uint8_t*>(a.keys) + static_cast<int64_t>(key_slot) * TOKEN_BYTES;
      b.rope[i] = __ldg(reinterpret_cast<const uint4*>(token + ROPE_OFFSET) + lane % ROPE_CHUNKS);
    }
  }
  return b;
}

// Dequantizes a batch into key rows first.. of a stage (576 bf16 columns, swizzled).
__device__ __forceinline__ void store_batch(const Batch& b, uint8_t* rows, int first, int lane) {
#pragma unroll
  for (int j = 0; j < KEYS_IN_FLIGHT; ++j) {
    uint4 lo, hi;
    dequant_chunk(b.latent[j], b.scale[j], lo, hi);
    *reinterpret_cast<uint4*>(rows + swizzle(first + j, 2 * lane)) = lo;
    *reinterpret_cast<uint4*>(rows + swizzle(first + j, 2 * lane + 1)) = hi;
  }
#pragma unroll
  for (int i = 0; i < KEYS_IN_FLIGHT / ROPE_KEYS_PER_LOAD; ++i) {
    const int key = first + ROPE_KEYS_PER_LOAD * i + lane / ROPE_CHUNKS;
    *reinterpret_cast<uint4*>(rows + swizzle(key, LATENT / 8 + lane % ROPE_CHUNKS)) = b.rope[i];
  }
}

// A producer lane's key ids: the current tile's (checked, -1 when invalid) and the next tile's
// (raw, read a tile ahead so that their loads are off the critical path). `bias_key` of every tile
// sets the scores' bias; `gather_key` is the key the lane's warp gathers.
struct LaneIds {
  const int32_t* ids;
  int start, end, tiles, bias_key, gather_key;
  int64_t num_keys;
  int bias, gather, next_bias, next_gather;

  __device__ __forceinline__ LaneIds(const SparseAttentionArgs& a, const Work& w, int bias_key_, int gather_key_)
      : ids(a.indices + w.row * a.topk), start(w.start), end(w.end), tiles(w.tiles), bias_key(bias_key_),
        gather_key(gather_key_), num_keys(a.num_keys) {
    bias = checked(read(0, bias_key));
    gather = checked(read(0, gather_key));
    next_bias = read(1, bias_key);
    next_gather = read(1, gather_key);
  }
  __device__ __forceinline__ int read(int t, int key) const {
    const int pos = start + t * KEYS + key;
    return t < tiles && pos < end ? ids[pos] : -1;
  }
  __device__ __forceinline__ int checked(int id) const { return id >= 0 && id < num_keys ? id : -1; }
  // Tile t + 1's ids become current; tile t + 2's are read.
  __device__ __forceinline__ void advance(int t) {
    bias = checked(next_bias);
    gather = checked(next_gather);
    next_bias = read(t + 2, bias_key);
    next_gather = read(t + 2, gather_key);
  }
};

// Waits until the pair's consumers are done with tile t - STAGES's stage, then sets tile t's score bias.
__device__ __forceinline__ void claim_stage(Shared& s, const LaneIds& ids, int t, int stage, int lane) {
  if (t >= STAGES) Barrier::wait(&s.empty[stage], ((t / STAGES) & 1) ^ 1);
  if (lane < 16) s.bias[stage][ids.bias_key] = ids.bias >= 0 ? 0.0f : -INFINITY;
}

constexpr int LEFT_BLOCKS = V_COLS_PER_WARP / BLOCK_COLS;  // column blocks of FULL's first half (4)

// Column blocks [first, end) of FULL half `half` (0: 0..3, 1: 4..DQK / 64 - 1).
__device__ __forceinline__ int half_begin(int half) { return half == 0 ? 0 : LEFT_BLOCKS; }
template <int DQK>
__device__ __forceinline__ int half_end(int half) { return half == 0 ? LEFT_BLOCKS : DQK / BLOCK_COLS; }

// This thread's part of FULL halves first..last of the stage is stored: fence it to wgmma; in a
// pair, once every producer of the CTA is done, send the CTA's rows of those column blocks to the
// peer, whose FULL halves count the bytes; then arrive on them.
template <int DQK, int PAIR>
__device__ __forceinline__ void hand_over(Shared& s, int stage, int rank, int first, int last) {
  fence_to_wgmma();
  if constexpr (PAIR > 1) {
    bar_sync(BAR_PRODUCERS, PRODUCER_THREADS);
    if (threadIdx.x == 0)
      for (int h = first; h <= last; ++h)
        Barrier::expect_transaction(&s.full[stage][h], KEYS / PAIR * 128 * (half_end<DQK>(h) - half_begin(h)));
    const int block = half_begin(first) + static_cast<int>(threadIdx.x);
    if (block < half_end<DQK>(last))
      copy_to_peer(s.k[stage][block] + rank * (KEYS / PAIR) * 128, rank ^ 1, KEYS / PAIR * 128,
                   &s.full[stage][block < LEFT_BLOCKS ? 0 : 1]);
  }
  for (int h = first; h <= last; ++h) Barrier::arrive(&s.full[stage][h]);
}

// FP8 keys. Producer warp `warp` (0..3): the scores' bias of keys 16 * warp .. 16 * warp + 15 of
// every tile, and the gather of keys rank * KEYS / PAIR + warp * per_warp .. (+ per_warp - 1), in
// batches of KEYS_IN_FLIGHT tokens. The loads of the next batch are in flight while a batch is
// stored (so the first batch of a tile is on its way before its stage is free).
template <int PAIR>
__device__ void produce_fp8(const SparseAttentionArgs& a, const Work& w, Shared& s, int rank) {
  constexpr int per_warp = KEYS / PAIR / PRODUCER_WARPS;  // 16, or 8 in a pair
  constexpr int batches = per_warp / KEYS_IN_FLIGHT;      // per tile
  static_assert(per_warp <= 16 && per_warp % KEYS_IN_FLIGHT == 0,
                "a producer warp's slot ids sit in lanes 0..15, taken KEYS_IN_FLIGHT at a time");
  if (w.tiles == 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first = rank * (KEYS / PAIR) + warp * per_warp;
  LaneIds ids(a, w, KEYS_PER_PRODUCER_WARP * warp + lane % 16, first + lane % per_warp);
  Batch batch = load_batch(a, ids.gather, 0, lane);
  for (int t = 0; t < w.tiles; ++t) {
    const int stage = t % STAGES;
    claim_stage(s, ids, t, stage, lane);
#pragma unroll
    for (int i = 0; i < batches; ++i) {
      Batch next;
      if (i + 1 < batches) {
        next = load_batch(a, ids.gather, (i + 1) * KEYS_IN_FLIGHT, lane);
      } else {  // the next tile's first batch (all ids -1 past the last tile: no loads)
        ids.advance(t);
        next = load_batch(a, ids.gather, 0, lane);
      }
      store_batch(batch, s.k[stage][0], first + i * KEYS_IN_FLIGHT, lane);
      batch = next;
    }
    hand_over<D_QK, PAIR>(s, stage, rank, 0, 1);
  }
}

// bf16 keys, DQK wide. Producer warp `warp`: per tile, the scores' bias as for FP8 keys and the rows
// of keys rank * KEYS / PAIR + warp * per_warp .. (+ per_warp - 1), copied straight into the stage
// with 16-byte cp.async (zero-filled for invalid ids, which are never read): lanes_per_key lanes
// take a row, lane l its chunks l % lanes_per_key + lanes_per_key * k. The warp's whole share of a
// tile is in flight at once, and the next tile's ids load meanwhile.
template <int DQK, int PAIR>
__device__ void produce_bf16(const SparseAttentionArgs& a, const Work& w, Shared& s, int rank) {
  constexpr int per_warp = KEYS / PAIR / PRODUCER_WARPS;  // 16, or 8 in a pair
  constexpr int lanes_per_key = 32 / per_warp;
  constexpr int row_chunks = DQK * 2 / 16;
  static_assert(32 % per_warp == 0 && row_chunks % lanes_per_key == 0 && 8 % lanes_per_key == 0,
                "a row's chunks split evenly over its lanes, each lane's chunk staying in its 8-chunk group");
  if (w.tiles == 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first = rank * (KEYS / PAIR) + warp * per_warp, key = first + lane / lanes_per_key;
  const int part = lane % lanes_per_key;
  LaneIds ids(a, w, KEYS_PER_PRODUCER_WARP * warp + lane % 16, key);
  const uint8_t* keys = static_cast<const uint8_t*>(a.keys);
  for (int t = 0; t < w.tiles; ++t) {
    const int stage = t % STAGES;
    claim_stage(s, ids, t, stage, lane);
    const uint8_t* src = keys + static_cast<int64_t>(max(ids.gather, 0)) * (DQK * 2) + part * 16;
    uint8_t* dst = s.k[stage][0] + key * 128;
    constexpr int left = LEFT_BLOCKS * 8 / lanes_per_key;  // the lane's chunks in FULL's first half
#pragma unroll
    for (int k = 0; k < row_chunks / lanes_per_key; ++k) {  // chunk c = lanes_per_key * k + part: swizzle(key, c)
      const int group = lanes_per_key * k / 8, in_group = (lanes_per_key * k) % 8;
      copy_async_16(dst + group * BLOCK_BYTES + (((in_group + part) ^ (key & 7)) << 4),
                    src + lanes_per_key * k * 16, ids.gather >= 0);
      if (k == left - 1) commit_copies();
    }
    commit_copies();
    ids.advance(t);
    if constexpr (PAIR > 1) {  // the scores start on the first half while the second's bulk copy is in flight
      wait_copies<1>();
      hand_over<DQK, PAIR>(s, stage, rank, 0, 0);
      wait_copies<0>();
      hand_over<DQK, PAIR>(s, stage, rank, 1, 1);
    } else {  // no copy to overlap: one arrival a thread (the split measured slower with 64 heads, one run)
      wait_copies<0>();
      hand_over<DQK, PAIR>(s, stage, rank, 0, 1);
    }
  }
}

// Hands stage `stage` back to the producers of the pair once this warp's wgmma reads of tile t are
// done (the last STAGES tiles are never refilled, so nobody waits for them).
template <int PAIR>
__device__ __forceinline__ void release_stage(Shared& s, const Work& w, int t, int stage, int rank) {
  if (t + STAGES < w.tiles) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
      Barrier::arrive(&s.empty[stage]);
      if constexpr (PAIR > 1) Barrier::arrive(&s.empty[stage], rank ^ 1, 1);
    }
  }
}

// acc *= alpha row by row (rows g, g + 8 of each fragment); skipped when no row of the warp moved
// its maximum, as most tiles do.
__device__ __forceinline__ void rescale(float (&acc)[O_TILES][4], const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int n = 0; n < O_TILES; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }
  }
}

// The consumers' last step: value columns 256c.. of acc * inv for rows g, g + 8 of consumer warp
// (r, c). With one split the bf16 rows go through the Q buffer
// (free once the last scores are done): each warp stores its fragments there, then all consumer
// threads copy the CTA's 64 contiguous output rows out in 16-byte chunks, whole lines at a time
// (the fragments' own 4-byte stores, 16 bytes to a row per instruction, took ~8 us of a 96 us
// decode at b=64). fp32 partials (splits > 1) are stored from the fragments, 32 bytes to a row.
__device__ __forceinline__ void store_output(const SparseAttentionArgs& a, const Work& w, Shared& s,
                                             const float (&acc)[O_TILES][4], const float (&inv)[2], int r, int c,
                                             int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const bool direct = a.splits == 1;
  const int col0 = V_COLS_PER_WARP * c + 2 * t4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int local = 16 * r + g + 8 * i, head = w.head_block * HEADS + local;
    if (direct) {
      uint8_t* row = s.q[0] + local * STAGED_ROW_BYTES + col0 * 2;
#pragma unroll
      for (int n = 0; n < O_TILES; ++n)
        *reinterpret_cast<uint32_t*>(row + 16 * n) = pack_bf16(acc[n][2 * i] * inv[i], acc[n][2 * i + 1] * inv[i]);
    } else {
      const int64_t part = (w.row * a.splits + w.split) * a.h_q + head;
      float* out = a.part_out + part * D_V + col0;
#pragma unroll
      for (int n = 0; n < O_TILES; ++n)
        *reinterpret_cast<float2*>(out + 8 * n) = make_float2(acc[n][2 * i] * inv[i], acc[n][2 * i + 1] * inv[i]);
    }
  }
  if (direct) {
    bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);  // both warpgroups' rows are staged
    uint4* out = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.out) +
                                          (w.row * a.h_q + w.head_block * HEADS) * D_V);
    constexpr int ROW_CHUNKS = D_V * 2 / 16;
#pragma unroll 4
    for (int i = threadIdx.x - PRODUCER_THREADS; i < HEADS * ROW_CHUNKS; i += CONSUMER_THREADS)
      out[i] = *reinterpret_cast<const uint4*>(s.q[0] + (i / ROW_CHUNKS) * STAGED_ROW_BYTES + (i % ROW_CHUNKS) * 16);
  }
}

// Warpgroup 0's last step, rows g, g + 8 of warp r: 1 / sum for warpgroup 1 (shared memory), the
// lse and (the forward) max_logits, or the split's partial lse. m is the rows' base-2 maximum, l
// the thread's share of their sums.
__device__ __forceinline__ void finish_rows(const SparseAttentionArgs& a, const Work& w, Shared& s, const float (&m)[2],
                                            const float (&l)[2], float (&inv)[2], int r, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float total = quad_sum(l[i]);
    const int local = 16 * r + g + 8 * i, head = w.head_block * HEADS + local;
    inv[i] = total > 0.0f ? 1.0f / total : 0.0f;
    const float lse = total > 0.0f ? (m[i] + log2f(total)) * LN2 : INFINITY;
    if (t4 != 0) continue;
    s.inv_sum[local] = inv[i];
    if (a.splits == 1) {
      const int64_t b = w.row / a.s_q, q_pos = w.row % a.s_q;
      a.lse[(b * a.h_q + head) * a.s_q + q_pos] = lse;
      if (a.max_logits != nullptr) a.max_logits[w.row * a.h_q + head] = total > 0.0f ? m[i] * LN2 : -INFINITY;
    } else {  // a partial without keys weighs 0 in the combine
      a.part_lse[(w.row * a.splits + w.split) * a.h_q + head] = total > 0.0f ? lse : -INFINITY;
    }
  }
}

// Warpgroup 0 (warp r: heads 16r..16r+15): per tile, the scores of its 64 heads against all 64 keys
// (S = Q K^T over DQK columns, m64n64k16, both operands in shared memory), the online softmax in
// base 2, P (bf16) and the rows' rescale factors handed to warpgroup 1 through shared memory, and
// O += P V for value columns 0..255 with P from registers (m64n256k16, RS).
template <int DQK, int PAIR>
__device__ void score_and_lower_values(const SparseAttentionArgs& a, const Work& w, Shared& s, int rank) {
  const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) % ROW_GROUPS;
  const int g = lane >> 2, t4 = lane & 3;  // accumulator fragment j: rows g and g + 8, columns 8j + 2t4 (+1)
  float acc[O_TILES][4];
#pragma unroll
  for (int n = 0; n < O_TILES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};  // running maxima (base-2 scaled scores) of rows g, g + 8
  float l[2] = {0.0f, 0.0f};            // this thread's share of their running sums
  const uint64_t q_desc = sw128_desc(s.q[0], 16, 1024);

  for (int t = 0; t < w.tiles; ++t) {
    const int stage = t % STAGES;
    const uint64_t k_desc = sw128_desc(s.k[stage][0], 16, 1024);
    const uint64_t v_desc = sw128_desc(s.k[stage][0], BLOCK_BYTES, 1024);  // column blocks 0..3, MN-major
    Barrier::wait(&s.full[stage][0], (t / STAGES) & 1);
    if constexpr (PAIR == 1) Barrier::wait(&s.full[stage][1], (t / STAGES) & 1);  // one batch: nothing to overlap

    // S = Q K^T, 16 columns a step (a column block is 4 steps of 32 bytes; descriptors count
    // 16-byte units); the first step overwrites sc. In a pair the first half's blocks go first,
    // while the rest of the stage (its bulk copy from the peer) may still be arriving.
    float sc[S_TILES][4];
    fence_fragments(sc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
      if (PAIR > 1 && kk == LEFT_BLOCKS * 4) {
        cute::warpgroup_commit_batch();
        Barrier::wait(&s.full[stage][1], (t / STAGES) & 1);
        cute::warpgroup_arrive();
      }
      const uint64_t step = ((kk / 4) * BLOCK_BYTES + (kk % 4) * 32) >> 4;
      wgmma<ScoreMma>(q_desc + step, k_desc + step, sc, kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One);
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_fragments(sc);

    // Scale to base 2, mask invalid keys, take the rows' maxima over the tile (a row's 64 keys sit
    // in the 4 lanes of a quad).
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) {
      const float2 bias = *reinterpret_cast<const float2*>(&s.bias[stage][8 * j + 2 * t4]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[j][e] = sc[j][e] * a.scale_log2 + ((e & 1) ? bias.y : bias.x);
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], sc[j][e]);
      }
    }
    float alpha[2], base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], quad_max(tile_max[i]));
      base[i] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing valid yet: all weights 0
      alpha[i] = exp2_approx(m[i] - base[i]);
      m[i] = m_new;
    }
    // P in bf16, packed as wgmma's A fragments: p[j][0] rows g, p[j][1] rows g + 8, keys 8j + 2t4 (+1).
    uint32_t p[S_TILES][2];
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[j][e] = exp2_approx(sc[j][e] - base[e >> 1]);
        sum[e >> 1] += sc[j][e];
      }
      p[j][0] = pack_bf16(sc[j][0], sc[j][1]);
      p[j][1] = pack_bf16(sc[j][2], sc[j][3]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + sum[i];

    if (t > 0) bar_sync(BAR_P_FREE, CONSUMER_THREADS);  // warpgroup 1 is done with the last tile's P
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) {
      *reinterpret_cast<uint32_t*>(s.p + swizzle(16 * r + g, j) + 4 * t4) = p[j][0];
      *reinterpret_cast<uint32_t*>(s.p + swizzle(16 * r + g + 8, j) + 4 * t4) = p[j][1];
    }
    if (t4 == 0) {
      s.alpha[16 * r + g] = alpha[0];
      s.alpha[16 * r + g + 8] = alpha[1];
    }
    fence_to_wgmma();
    bar_arrive(BAR_P_READY, CONSUMER_THREADS);

    // O += P V over the tile's 64 keys, 16 keys (2048 bytes of V rows) a step; A fragment ks is
    // keys 16ks.. of rows g (p[2ks][0], p[2ks + 1][0]) and g + 8.
    rescale(acc, alpha);
    fence_fragments(acc);
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) cute::warpgroup_fence_operand(p[j][0]), cute::warpgroup_fence_operand(p[j][1]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < KEYS / 16; ++ks)
      wgmma_rs<LowerOutputMma>({p[2 * ks][0], p[2 * ks][1], p[2 * ks + 1][0], p[2 * ks + 1][1]}, v_desc + ks * 128,
                               acc);
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_fragments(acc);
    release_stage<PAIR>(s, w, t, stage, rank);
  }

  float inv[2];
  finish_rows(a, w, s, m, l, inv, r, lane);
  bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);  // warpgroup 1 takes 1 / sum from shared memory
  store_output(a, w, s, acc, inv, r, 0, lane);
}

// Warpgroup 1 (warp r: heads 16r..16r+15): per tile, once warpgroup 0 has written P and the rescale
// factors, O += P V for value columns 256..511 (m64n256k16, P and V from shared memory).
template <int PAIR>
__device__ void upper_values(const SparseAttentionArgs& a, const Work& w, Shared& s, int rank) {
  const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) % ROW_GROUPS;
  const int g = lane >> 2;
  float acc[O_TILES][4];
#pragma unroll
  for (int n = 0; n < O_TILES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const uint64_t p_desc = sw128_desc(s.p, 16, 1024);

  for (int t = 0; t < w.tiles; ++t) {
    const int stage = t % STAGES;
    const uint64_t v_desc = sw128_desc(s.k[stage][V_COLS_PER_WARP / BLOCK_COLS], BLOCK_BYTES, 1024);
    bar_sync(BAR_P_READY, CONSUMER_THREADS);
    Barrier::wait(&s.full[stage][1], (t / STAGES) & 1);  // complete already (warpgroup 0 waited for it)
    const float alpha[2] = {s.alpha[16 * r + g], s.alpha[16 * r + g + 8]};
    rescale(acc, alpha);
    fence_fragments(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < KEYS / 16; ++ks) wgmma<UpperOutputMma>(p_desc + ks * 2, v_desc + ks * 128, acc);
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_fragments(acc);
    if (t + 1 < w.tiles) bar_arrive(BAR_P_FREE, CONSUMER_THREADS);
    release_stage<PAIR>(s, w, t, stage, rank);
  }

  bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);
  const float inv[2] = {s.inv_sum[16 * r + g], s.inv_sum[16 * r + g + 8]};
  store_output(a, w, s, acc, inv, r, 1, lane);
}

// The CTA's 64 query rows (DQK wide) into shared memory (bf16, swizzled) by both consumer
// warpgroups, as 16-byte asynchronous copies that are all in flight at once (plain loads and stores
// would wait for each load in turn: the compiler cannot move a load past a store that may alias it).
template <int DQK>
__device__ __forceinline__ void load_q(const SparseAttentionArgs& a, const Work& w, Shared& s) {
  const int tid = threadIdx.x - PRODUCER_THREADS;
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q) + (w.row * a.h_q + w.head_block * HEADS) * DQK;
#pragma unroll
  for (int i = tid; i < HEADS * DQK / 8; i += CONSUMER_THREADS) {
    const int head = i / (DQK / 8), chunk = i % (DQK / 8);
    copy_async_16(s.q[0] + swizzle(head, chunk), q + static_cast<int64_t>(head) * DQK + chunk * 8, true);
  }
  commit_copies();
  wait_copies<0>();
  fence_to_wgmma();
  bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);
}

// The key sources: the FP8 cache's 656-byte tokens, or bf16 rows DQK wide.
struct Fp8Keys {
  static constexpr bool kFp8 = true;
  static constexpr int kDqk = D_QK;
};
template <int DQK>
struct Bf16Keys {
  static constexpr bool kFp8 = false;
  static constexpr int kDqk = DQK;
  static_assert(DQK % BLOCK_COLS == 0 && DQK >= D_V && DQK <= D_QK, "whole column blocks, V inside, fits the stages");
};

// PAIR = 2: the CTAs of head blocks 2i and 2i + 1 form a cluster (launched with cluster dims 2).
template <class Keys, int PAIR>
__global__ void __launch_bounds__(THREADS, 1) attention_kernel(const __grid_constant__ SparseAttentionArgs args) {
  extern __shared__ __align__(128) uint8_t smem[];
  Shared& s = *reinterpret_cast<Shared*>(smem);
  const Work w = work_of(args);
  const int rank = w.head_block % PAIR;
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < STAGES; ++stage) {
      Barrier::init(&s.full[stage][0], PRODUCER_THREADS);
      Barrier::init(&s.full[stage][1], PRODUCER_THREADS);
      Barrier::init(&s.empty[stage], CONSUMER_WARPS * PAIR);
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (PAIR > 1) cute::cluster_sync();  // the peer's barriers exist before anything reaches them
  else __syncthreads();
  if (threadIdx.x < PRODUCER_THREADS) {
    cutlass::arch::warpgroup_reg_dealloc<PRODUCER_REGS>();
    if constexpr (Keys::kFp8) produce_fp8<PAIR>(args, w, s, rank);
    else produce_bf16<Keys::kDqk, PAIR>(args, w, s, rank);
  } else if (threadIdx.x < PRODUCER_THREADS + WARPGROUP_THREADS) {
    cutlass::arch::warpgroup_reg_alloc<SCORE_REGS>();
    load_q<Keys::kDqk>(args, w, s);
    score_and_lower_values<Keys::kDqk, PAIR>(args, w, s, rank);
  } else {
    cutlass::arch::warpgroup_reg_dealloc<VALUE_REGS>();
    load_q<Keys::kDqk>(args, w, s);
    upper_values<PAIR>(args, w, s, rank);
  }
  if constexpr (PAIR > 1) cute::cluster_sync();  // neither CTA leaves while the other may still reach it
}

// One CTA per (row, head): out = sum_s exp(lse_s - lse) out_s, lse = ln sum_s exp(lse_s).
__global__ void __launch_bounds__(COMBINE_THREADS) combine_kernel(const __grid_constant__ SparseAttentionArgs a) {
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

// Launches attention_kernel<Keys, pair> and, for splits > 1, the combine.
template <class Keys>
cudaError_t launch(const SparseAttentionArgs& args, int device, cudaStream_t stream, int64_t ctas) {
  const int bytes = sizeof(Shared);
  // Head blocks in pairs share the gather, where a split is long enough to repay the cluster's
  // extra latency (a bulk copy and a producer barrier per tile).
  const bool pair = (args.h_q / HEADS) % 2 == 0 && args.tokens_per_split >= PAIR_MIN_TILES * KEYS;
  const auto kernel = pair ? attention_kernel<Keys, 2> : attention_kernel<Keys, 1>;
  cudaError_t err = pair ? opt_in_shared_memory<attention_kernel<Keys, 2>>(bytes, device)
                         : opt_in_shared_memory<attention_kernel<Keys, 1>>(bytes, device);
  if (err == cudaSuccess) {
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = pair ? 2 : 1;
    cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(ctas));
    config.blockDim = dim3(THREADS);
    config.dynamicSmemBytes = bytes;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    err = cudaLaunchKernelEx(&config, kernel, args);
  }
  if (err == cudaSuccess && args.splits > 1) {
    combine_kernel<<<static_cast<unsigned>(args.rows * args.h_q), COMBINE_THREADS, 0, stream>>>(args);
    err = cudaGetLastError();
  }
  return err;
}

}  // namespace

const char* launch_sparse_attention(const SparseAttentionArgs& args, int device, void* stream) {
  if (args.rows == 0) return nullptr;
  if (args.h_q % HEADS != 0 || args.splits < 1 || args.splits > kSparseMaxSplits ||
      args.tokens_per_split % KEYS != 0 || args.topk < 1 || args.topk > kSparseMaxTopk ||
      (args.max_logits != nullptr && args.splits > 1))
    return "sparse attention: unsupported h_q, splits, tokens_per_split, topk or max_logits with splits "
           "(the ops check these first)";
  const bool fp8 = args.format == KeyFormat::kFp8Cache;
  if ((fp8 && args.d_qk != D_QK) || (!fp8 && args.d_qk != D_QK && args.d_qk != D_V))
    return "sparse attention: d_qk must be 576 (FP8 cache) or 512 / 576 (bf16 keys)";
  const int64_t ctas = args.rows * (args.h_q / HEADS) * args.splits;
  if (ctas > 0x7fffffff) return "sparse attention: more than 2^31 - 1 CTAs";
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (fp8) err = launch<Fp8Keys>(args, device, cuda_stream, ctas);
  else if (args.d_qk == D_QK) err = launch<Bf16Keys<D_QK>>(args, device, cuda_stream, ctas);
  else err = launch<Bf16Keys<D_V>>(args, device, cuda_stream, ctas);
  if (previous != device) cudaSetDevice(previous);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace flashdsa
