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
#include "sparse_attention.h"

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
constexpr int LAUNCH_REGS = 168;  // a thread's registers at 384 threads, one CTA an SM (setmaxnreg moves them)
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
static_assert(PRODUCER_THREADS == WARPGROUP_THREADS, "one producer warpgroup");

struct Shared {
  alignas(1024) uint8_t q[D_QK / BLOCK_COLS][BLOCK_BYTES];          // the CTA's 64 query rows, bf16
  alignas(1024) uint8_t k[STAGES][D_QK / BLOCK_COLS][BLOCK_BYTES];  // dequantized keys; columns < 512 are V
  alignas(1024) uint8_t p[BLOCK_BYTES];                             // probabilities of the current tile, bf16
  float bias[STAGES][KEYS];                                         // 0 for a valid slot id, -inf otherwise
  float alpha[HEADS];                                               // the rows' rescale factors of the current tile
  float inv_sum[HEADS];                                             // 1 / the rows' sums, at the end
  float row_max[HEADS];                                             // seesaw: the rows' maxima, handed over
  float part_sum[2][HEADS];                                         // seesaw: each warpgroup's share of the sums
  uint64_t full[STAGES];                                            // the stage's keys are in place
  uint64_t empty[STAGES];                                           // the pair's consumers are done with it
  uint64_t half_full[STAGES][2];                                    // seesaw: column blocks 0..3 / 4.. in place
  uint64_t half_empty[STAGES][2];                                   // seesaw: their readers are done
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
// The seesaw consumers (bf16 keys): the rows' maxima after the first warpgroup's tile, then after
// the second's; each warpgroup's P of the pair of tiles in shared memory.
constexpr int BAR_MAX_FIRST = 5;
constexpr int BAR_MAX_SECOND = 6;
constexpr int BAR_P_FIRST = 7;
constexpr int BAR_P_SECOND = 8;
using Barrier = cutlass::arch::ClusterTransactionBarrier;

// Named barriers, unaligned forms: the warps of a barrier reach it from different role branches
// (different barrier instructions), which the aligned bar.sync forbids.
__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

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

// Makes this thread's shared-memory stores visible to wgmma (the async proxy); the barrier after
// it hands them over. (CUTLASS's fence_view_async_shared has no memory clobber, so the compiler
// could move the stores past it.)
__device__ __forceinline__ void fence_to_wgmma() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// 16 bytes from global `src` to shared `dst` without registers (cp.async, the L2 fetching the
// surrounding 256 bytes: the rest of a row follows; commit and wait apart);
// with valid false nothing is read and dst gets zeros.
__device__ __forceinline__ void copy_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

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
using ScoreMma = gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
using LowerOutputMma = gmma::MMA_64x256x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;  // P from registers
using UpperOutputMma = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::MN>;  // P from shared memory

// d += A B for one wgmma `Mma` whose accumulator is d's N / 8 fragments of 4 floats.
template <typename Mma, int N, size_t... I>
__device__ __forceinline__ void wgmma_fragments(uint64_t a, uint64_t b, float (&d)[N][4], gmma::ScaleOut scale_d,
                                                std::index_sequence<I...>) {
  Mma::fma(a, b, d[I / 4][I % 4]..., scale_d);
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

// The CTA's work: query row, head block, split, its [start, end) of the top-k list and the tiles
// of 64 keys that cover it (an even count for the seesaw consumers: the last may be all padding).
struct Work {
  int64_t row;
  int head_block;
  int split;
  int start, end, tiles;
};

__device__ __forceinline__ Work work_of(const SparseAttentionArgs& a, bool even_tiles) {
  const int head_blocks = a.h_q / HEADS;
  Work w;
  w.head_block = static_cast<int>(blockIdx.x % head_blocks);
  w.split = static_cast<int>((blockIdx.x / head_blocks) % a.splits);
  w.row = static_cast<int64_t>(blockIdx.x / (head_blocks * a.splits));
  w.start = w.split * a.tokens_per_split;
  w.end = min(w.start + a.tokens_per_split, a.topk);
  w.tiles = w.end > w.start ? (w.end - w.start + KEYS - 1) / KEYS : 0;
  if (even_tiles) w.tiles += w.tiles & 1;
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

// This thread's part of the stage is stored: fence it to wgmma; in a pair, once every producer of
// the CTA is done, send the CTA's half of the tile (its rows of each column block) to the peer,
// whose FULL barrier counts the bytes; then arrive on FULL.
template <int DQK, int PAIR>
__device__ __forceinline__ void hand_over_stage(Shared& s, int stage, int rank) {
  fence_to_wgmma();
  if constexpr (PAIR > 1) {
    bar_sync(BAR_PRODUCERS, PRODUCER_THREADS);
    if (threadIdx.x == 0) Barrier::expect_transaction(&s.full[stage], KEYS / PAIR * DQK * 2);
    if (threadIdx.x < DQK / BLOCK_COLS)
      copy_to_peer(s.k[stage][threadIdx.x] + rank * (KEYS / PAIR) * 128, rank ^ 1, KEYS / PAIR * 128, &s.full[stage]);
  }
  Barrier::arrive(&s.full[stage]);
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
    hand_over_stage<D_QK, PAIR>(s, stage, rank);
  }
}

// The seesaw's stages in halves: L = column blocks 0..3 (value columns 0..255), R = blocks 4.. (value
// columns 256..511 and the RoPE block). Stage 0 (the first warpgroup's tile) is scored L first and
// stage 1 R first, so each warpgroup starts its Q K^T on the half its own P V freed early, while the
// other half (freed by the other warpgroup's P V) is still loading.
__device__ __forceinline__ constexpr int first_half(int stage) { return stage; }

// Makes mbarrier `bar` count one arrival once all of this thread's cp.async so far have landed.
__device__ __forceinline__ void arrive_when_copied(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
}

// bf16 keys, DQK wide, for the seesaw consumers (no cluster: each CTA reads its rows, the L2 serves
// the other head block). Per pair of tiles the producer fills stage 0 L, stage 1 R, stage 0 R,
// stage 1 L, each once its readers have released it, with 16-byte cp.async (zero-filled for
// invalid ids, which are never read) that arrive on the half's FULL barrier when they land: the
// producer never waits for its copies. Two lanes take a row (lane l its chunks l % 2 + 2k); warp w
// the rows 16w..16w+15 and the scores' bias of the same keys, written with the first half of a stage
// (each thread arrives on that half's FULL barrier once more, after its bias store).
template <int DQK>
__device__ void produce_halves(const SparseAttentionArgs& a, const Work& w, Shared& s) {
  constexpr int per_warp = KEYS / PRODUCER_WARPS, lanes_per_key = 32 / per_warp;
  constexpr int half_chunks[2] = {4 * 8, DQK / 8 - 4 * 8};  // 16-byte chunks of a row in L, R
  static_assert(lanes_per_key == 2 && half_chunks[1] % lanes_per_key == 0, "two lanes a row");
  if (w.tiles == 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int key = warp * per_warp + lane / lanes_per_key, part = lane % lanes_per_key;
  const int32_t* ids = a.indices + w.row * a.topk;
  const auto read = [&](int t, int k) { const int pos = w.start + t * KEYS + k; return t < w.tiles && pos < w.end ? ids[pos] : -1; };
  const auto checked = [&](int id) { return id >= 0 && id < a.num_keys ? id : -1; };
  const uint8_t* keys = static_cast<const uint8_t*>(a.keys);
  int raw[2] = {read(0, key), read(1, key)};  // ids of the next pair, read a pair ahead
  for (int t0 = 0; t0 < w.tiles; t0 += 2) {
    const int id[2] = {checked(raw[0]), checked(raw[1])};
#pragma unroll
    for (int step = 0; step < 4; ++step) {  // (stage, half): (0, L), (1, R), (0, R), (1, L)
      const int stage = step & 1, half = stage ^ (step >> 1);
      if (t0 >= STAGES) Barrier::wait(&s.half_empty[stage][half], ((t0 / STAGES) & 1) ^ 1);
      const uint8_t* src = keys + static_cast<int64_t>(max(id[stage], 0)) * (DQK * 2) + (half * 32 + part) * 16;
      uint8_t* dst = s.k[stage][4 * half] + key * 128;
#pragma unroll
      for (int k = 0; k < half_chunks[1] / lanes_per_key; ++k) {
        if (half == 0 && k >= half_chunks[0] / lanes_per_key) break;
        const int c = lanes_per_key * k + part;  // chunk within the half
        copy_async_16(dst + (c / 8) * BLOCK_BYTES + (((c % 8) ^ (key & 7)) << 4), src + lanes_per_key * k * 16,
                      id[stage] >= 0);
      }
      arrive_when_copied(&s.half_full[stage][half]);
      if (half == first_half(stage)) {
        if (part == 0) s.bias[stage][key] = id[stage] >= 0 ? 0.0f : -INFINITY;
        Barrier::arrive(&s.half_full[stage][half]);
      }
    }
    raw[0] = read(t0 + 2, key), raw[1] = read(t0 + 3, key);
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

// The rows' lse and (the forward) max_logits, or the split's partial lse, for rows g, g + 8 of warp r
// given their base-2 maxima m and their whole sums.
__device__ __forceinline__ void store_row_stats(const SparseAttentionArgs& a, const Work& w, const float (&m)[2],
                                                const float (&total)[2], int r, int lane) {
  if ((lane & 3) != 0) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int head = w.head_block * HEADS + 16 * r + (lane >> 2) + 8 * i;
    const float lse = total[i] > 0.0f ? (m[i] + log2f(total[i])) * LN2 : INFINITY;
    if (a.splits == 1) {
      const int64_t b = w.row / a.s_q, q_pos = w.row % a.s_q;
      a.lse[(b * a.h_q + head) * a.s_q + q_pos] = lse;
      if (a.max_logits != nullptr) a.max_logits[w.row * a.h_q + head] = total[i] > 0.0f ? m[i] * LN2 : -INFINITY;
    } else {  // a partial without keys weighs 0 in the combine
      a.part_lse[(w.row * a.splits + w.split) * a.h_q + head] = total[i] > 0.0f ? lse : -INFINITY;
    }
  }
}

// Issues S (+)= Q K^T over column blocks [B0, B1): the 64 heads against the 64 keys of `stage`
// (m64n64k16, both operands in shared memory, 16 columns a step: a column block is 4 steps of 32
// bytes; descriptors count 16-byte units). With `overwrite` the first step overwrites sc.
template <int B0, int B1>
__device__ __forceinline__ void issue_scores(Shared& s, int stage, float (&sc)[S_TILES][4], bool overwrite) {
  const uint64_t q_desc = sw128_desc(s.q[0], 16, 1024), k_desc = sw128_desc(s.k[stage][0], 16, 1024);
#pragma unroll
  for (int kk = 4 * B0; kk < 4 * B1; ++kk) {
    const uint64_t step = ((kk / 4) * BLOCK_BYTES + (kk % 4) * 32) >> 4;
    wgmma<ScoreMma>(q_desc + step, k_desc + step, sc,
                    overwrite && kk == 4 * B0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One);
  }
}

// S = Q K^T over DQK columns of `stage`, waited for.
template <int DQK>
__device__ __forceinline__ void score_tile(Shared& s, int stage, float (&sc)[S_TILES][4]) {
  fence_fragments(sc);
  cute::warpgroup_arrive();
  issue_scores<0, DQK / BLOCK_COLS>(s, stage, sc, true);
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  fence_fragments(sc);
}

// Scales the scores to base 2 and masks invalid keys (bias -inf); returns the rows' maxima over the
// tile (a row's 64 keys sit in the 4 lanes of a quad). Accumulator fragment j: rows g and g + 8,
// keys 8j + 2t4 (+1).
__device__ __forceinline__ void scale_and_mask(float (&sc)[S_TILES][4], const float* bias, float scale_log2,
                                               float (&tile_max)[2], int t4) {
  tile_max[0] = tile_max[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < S_TILES; ++j) {
    const float2 b = *reinterpret_cast<const float2*>(bias + 8 * j + 2 * t4);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sc[j][e] = sc[j][e] * scale_log2 + ((e & 1) ? b.y : b.x);
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], sc[j][e]);
    }
  }
  tile_max[0] = quad_max(tile_max[0]);
  tile_max[1] = quad_max(tile_max[1]);
}

// The exponent base of a row whose running maximum is m: a row with nothing valid yet (m = -inf)
// takes 0, so that its weights exp2(-inf - 0) are 0 and its rescale factors finite.
__device__ __forceinline__ float exponent_base(float m) { return m == -INFINITY ? 0.0f : m; }

// sc = exp2(sc - base) row by row; adds the thread's share of the rows' sums to sum.
__device__ __forceinline__ void exponentiate(float (&sc)[S_TILES][4], const float (&base)[2], float (&sum)[2]) {
#pragma unroll
  for (int j = 0; j < S_TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sc[j][e] = exp2_approx(sc[j][e] - base[e >> 1]);
      sum[e >> 1] += sc[j][e];
    }
}

// P = sc * scale (per row) in bf16, packed as wgmma's A fragments: p[j][0] rows g, p[j][1] rows g + 8.
__device__ __forceinline__ void pack_p(const float (&sc)[S_TILES][4], const float (&scale)[2], uint32_t (&p)[S_TILES][2]) {
#pragma unroll
  for (int j = 0; j < S_TILES; ++j) {
    p[j][0] = pack_bf16(sc[j][0] * scale[0], sc[j][1] * scale[0]);
    p[j][1] = pack_bf16(sc[j][2] * scale[1], sc[j][3] * scale[1]);
  }
}

// Writes warp r's P fragments into a 64 x 64 bf16 tile in shared memory (swizzled, one column block).
__device__ __forceinline__ void store_p(uint8_t* tile, const uint32_t (&p)[S_TILES][2], int r, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < S_TILES; ++j) {
    *reinterpret_cast<uint32_t*>(tile + swizzle(16 * r + g, j) + 4 * t4) = p[j][0];
    *reinterpret_cast<uint32_t*>(tile + swizzle(16 * r + g + 8, j) + 4 * t4) = p[j][1];
  }
}

// Issues acc += P V over a tile's 64 keys with P from registers (m64n256k16, RS), V = 256 value
// columns (MN-major, read in place from the key rows) at v_desc; 16 keys (2048 bytes of V rows) a
// step, A fragment ks = keys 16ks.. of rows g (p[2ks][0], p[2ks + 1][0]) and g + 8. Commits it.
__device__ __forceinline__ void issue_values_rs(uint32_t (&p)[S_TILES][2], uint64_t v_desc, float (&acc)[O_TILES][4]) {
  fence_fragments(acc);
#pragma unroll
  for (int j = 0; j < S_TILES; ++j) cute::warpgroup_fence_operand(p[j][0]), cute::warpgroup_fence_operand(p[j][1]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < KEYS / 16; ++ks)
    wgmma_rs<LowerOutputMma>({p[2 * ks][0], p[2 * ks][1], p[2 * ks + 1][0], p[2 * ks + 1][1]}, v_desc + ks * 128, acc);
  cute::warpgroup_commit_batch();
}

// Issues acc += P V with P from a shared-memory tile (m64n256k16, SS). Commits it.
__device__ __forceinline__ void issue_values_ss(const uint8_t* p_tile, uint64_t v_desc, float (&acc)[O_TILES][4]) {
  const uint64_t p_desc = sw128_desc(p_tile, 16, 1024);
  fence_fragments(acc);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < KEYS / 16; ++ks) wgmma<UpperOutputMma>(p_desc + ks * 2, v_desc + ks * 128, acc);
  cute::warpgroup_commit_batch();
}

// The value columns 256c..256c+255 of a stage (MN-major descriptor over column blocks 4c..4c+3).
__device__ __forceinline__ uint64_t value_desc(Shared& s, int stage, int c) {
  return sw128_desc(s.k[stage][c * (V_COLS_PER_WARP / BLOCK_COLS)], BLOCK_BYTES, 1024);
}

__device__ __forceinline__ void zero(float (&acc)[O_TILES][4]) {
#pragma unroll
  for (int n = 0; n < O_TILES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// Warpgroup 0 (warp r: heads 16r..16r+15): per tile, the scores of its 64 heads against all 64 keys,
// the online softmax in base 2, P (bf16) and the rows' rescale factors handed to warpgroup 1 through
// shared memory, and O += P V for value columns 0..255 with P from registers.
template <int DQK, int PAIR>
__device__ void score_and_lower_values(const SparseAttentionArgs& a, const Work& w, Shared& s, int rank) {
  const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) % ROW_GROUPS;
  const int g = lane >> 2, t4 = lane & 3;
  float acc[O_TILES][4];
  zero(acc);
  float m[2] = {-INFINITY, -INFINITY};  // running maxima (base-2 scaled scores) of rows g, g + 8
  float l[2] = {0.0f, 0.0f};            // this thread's share of their running sums
  const float one[2] = {1.0f, 1.0f};

  for (int t = 0; t < w.tiles; ++t) {
    const int stage = t % STAGES;
    Barrier::wait(&s.full[stage], (t / STAGES) & 1);
    float sc[S_TILES][4], tile_max[2], alpha[2], base[2], sum[2] = {0.0f, 0.0f};
    score_tile<DQK>(s, stage, sc);
    scale_and_mask(sc, s.bias[stage], a.scale_log2, tile_max, t4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], tile_max[i]);
      base[i] = exponent_base(m_new);
      alpha[i] = exp2_approx(m[i] - base[i]);
      m[i] = m_new;
    }
    exponentiate(sc, base, sum);
    uint32_t p[S_TILES][2];
    pack_p(sc, one, p);
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + sum[i];

    if (t > 0) bar_sync(BAR_P_FREE, CONSUMER_THREADS);  // warpgroup 1 is done with the last tile's P
    store_p(s.p, p, r, lane);
    if (t4 == 0) {
      s.alpha[16 * r + g] = alpha[0];
      s.alpha[16 * r + g + 8] = alpha[1];
    }
    fence_to_wgmma();
    bar_arrive(BAR_P_READY, CONSUMER_THREADS);

    rescale(acc, alpha);
    issue_values_rs(p, value_desc(s, stage, 0), acc);
    cute::warpgroup_wait<0>();
    fence_fragments(acc);
    release_stage<PAIR>(s, w, t, stage, rank);
  }

  float total[2], inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    total[i] = quad_sum(l[i]);
    inv[i] = total[i] > 0.0f ? 1.0f / total[i] : 0.0f;
    if (t4 == 0) s.inv_sum[16 * r + g + 8 * i] = inv[i];
  }
  store_row_stats(a, w, m, total, r, lane);
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
  zero(acc);

  for (int t = 0; t < w.tiles; ++t) {
    const int stage = t % STAGES;
    bar_sync(BAR_P_READY, CONSUMER_THREADS);
    Barrier::wait(&s.full[stage], (t / STAGES) & 1);  // complete already (warpgroup 0 waited for it)
    const float alpha[2] = {s.alpha[16 * r + g], s.alpha[16 * r + g + 8]};
    rescale(acc, alpha);
    issue_values_ss(s.p, value_desc(s, stage, 1), acc);
    cute::warpgroup_wait<0>();
    fence_fragments(acc);
    if (t + 1 < w.tiles) bar_arrive(BAR_P_FREE, CONSUMER_THREADS);
    release_stage<PAIR>(s, w, t, stage, rank);
  }

  bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);
  const float inv[2] = {s.inv_sum[16 * r + g], s.inv_sum[16 * r + g + 8]};
  store_output(a, w, s, acc, inv, r, 1, lane);
}

// The seesaw consumers (bf16 keys, after FlashMLA's prefill): tiles come in pairs, tile 2i in stage
// 0 for warpgroup 0 ("first") and tile 2i + 1 in stage 1 for warpgroup 1 ("second"); each warpgroup
// scores its own tile (so one's Q K^T runs on the tensor cores while the other runs its softmax)
// and accumulates P V of both tiles for its half of the value columns (256c..256c+255): its own P
// from registers, the other's from shared memory. The row maxima chain through shared memory: the
// first takes max(m, its tile) and hands it over; the second takes max(that, its tile), the pair's
// maximum, and hands it back; the first then rescales its P and O to it before sending P. P of the
// first sits in stage 0's RoPE column block (free once the first has scored the tile; 512-wide keys
// leave it unused), P of the second in s.p. Stage 0 is released by the first after its own P V and
// by the second after P(first) V; stage 1 the other way round. The tile count is even (the producer
// pads with a tile of invalid keys).
template <int DQK, int C>
__device__ void seesaw(const SparseAttentionArgs& a, const Work& w, Shared& s) {
  constexpr int own = C, other = 1 - C;  // stages (and value column halves)
  const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) % ROW_GROUPS;
  const int g = lane >> 2, t4 = lane & 3;
  uint8_t* p_tile[2] = {s.k[0][D_QK / BLOCK_COLS - 1], s.p};
  float acc[O_TILES][4];
  zero(acc);
  float m[2] = {-INFINITY, -INFINITY};  // running maxima (base-2 scaled scores) of rows g, g + 8
  float l[2] = {0.0f, 0.0f};            // this thread's share of this warpgroup's running sums
  const float one[2] = {1.0f, 1.0f};

  constexpr int L = 0, R = 1, blocks = DQK / BLOCK_COLS;
  const auto release = [&](int t, int stage, int half) {  // the last tiles of a stage are never refilled
    if (t + STAGES < w.tiles) {
      __syncwarp();
      if (lane == 0) Barrier::arrive(&s.half_empty[stage][half]);
    }
  };
  // Q K^T of own tile t, the half that loaded first first (each half its own commit group).
  float sc[S_TILES][4];
  const auto score_first_half = [&](int t) {
    Barrier::wait(&s.half_full[own][first_half(own)], (t / 2) & 1);
    fence_fragments(sc);
    cute::warpgroup_arrive();
    if constexpr (C == 0) issue_scores<0, 4>(s, own, sc, true);
    else issue_scores<4, blocks>(s, own, sc, true);
    cute::warpgroup_commit_batch();
  };
  const auto score_second_half = [&](int t) {
    Barrier::wait(&s.half_full[own][first_half(own) ^ 1], (t / 2) & 1);
    cute::warpgroup_arrive();
    if constexpr (C == 0) issue_scores<4, blocks>(s, own, sc, false);
    else issue_scores<0, 4>(s, own, sc, false);
    cute::warpgroup_commit_batch();
  };
  if (C == 0 && own < w.tiles) {  // the first issues each next tile's Q K^T behind its last P V
    score_first_half(own);
    score_second_half(own);
  }
  for (int t = own; t < w.tiles; t += 2) {
    const int phase = (t / 2) & 1;
    float tile_max[2], alpha[2], base[2], sum[2] = {0.0f, 0.0f};
    if constexpr (C == 1) {
      score_first_half(t);
      score_second_half(t);
    }
    cute::warpgroup_wait<0>();
    fence_fragments(sc);
    scale_and_mask(sc, s.bias[own], a.scale_log2, tile_max, t4);
    float start[2] = {m[0], m[1]};  // the second starts from the first's maximum of this pair
    if constexpr (C == 1) {
      bar_sync(BAR_MAX_FIRST, CONSUMER_THREADS);
      start[0] = s.row_max[16 * r + g];
      start[1] = s.row_max[16 * r + g + 8];
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(start[i], tile_max[i]);
      base[i] = exponent_base(m_new);
      alpha[i] = exp2_approx(m[i] - base[i]);
      m[i] = m_new;
    }
    __syncwarp();  // the quad has read row_max before its lane 0 overwrites it
    if (t4 == 0) {
      s.row_max[16 * r + g] = m[0];
      s.row_max[16 * r + g + 8] = m[1];
    }
    bar_arrive(C == 0 ? BAR_MAX_FIRST : BAR_MAX_SECOND, CONSUMER_THREADS);
    exponentiate(sc, base, sum);
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + sum[i];
    uint32_t p[S_TILES][2];
    pack_p(sc, one, p);
    rescale(acc, alpha);
    issue_values_rs(p, value_desc(s, own, C), acc);
    if constexpr (C == 0) {
      cute::warpgroup_wait<0>();
      fence_fragments(acc);
      release(t, own, L);
      // The pair's maximum from the second: P and O (and the sums) to its scale.
      bar_sync(BAR_MAX_SECOND, CONSUMER_THREADS);
      float scale[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float pair_max = s.row_max[16 * r + g + 8 * i];
        scale[i] = exp2_approx(m[i] - exponent_base(pair_max));  // m = -inf: nothing to scale (P, O, l are 0)
        m[i] = pair_max;
        l[i] *= scale[i];
      }
      pack_p(sc, scale, p);
      store_p(p_tile[own], p, r, lane);
      fence_to_wgmma();
      bar_arrive(BAR_P_FIRST, CONSUMER_THREADS);
      rescale(acc, scale);
      bar_sync(BAR_P_SECOND, CONSUMER_THREADS);
      Barrier::wait(&s.half_full[other][L], phase);  // complete already (the second scored it)
      issue_values_ss(p_tile[other], value_desc(s, other, C), acc);
      if (t + 2 < w.tiles) {  // the next tile's first half while this P V runs (groups complete in order)
        score_first_half(t + 2);
        cute::warpgroup_wait<1>();
        fence_fragments(acc);
        release(t + 1, other, L);
        score_second_half(t + 2);
      } else {
        cute::warpgroup_wait<0>();
        fence_fragments(acc);
        release(t + 1, other, L);
      }
    } else {
      store_p(p_tile[own], p, r, lane);
      fence_to_wgmma();
      bar_sync(BAR_P_FIRST, CONSUMER_THREADS);
      Barrier::wait(&s.half_full[other][R], phase);  // complete already (the first scored it)
      issue_values_ss(p_tile[other], value_desc(s, other, C), acc);
      bar_arrive(BAR_P_SECOND, CONSUMER_THREADS);
      cute::warpgroup_wait<1>();
      release(t, own, R);
      cute::warpgroup_wait<0>();
      fence_fragments(acc);
      release(t - 1, other, R);
    }
  }

  // Both warpgroups end on the same maxima; the rows' sums add their shares.
  float total[2], inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    total[i] = quad_sum(l[i]);
    if (t4 == 0) s.part_sum[C][16 * r + g + 8 * i] = total[i];
  }
  bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    total[i] += s.part_sum[other][16 * r + g + 8 * i];
    inv[i] = total[i] > 0.0f ? 1.0f / total[i] : 0.0f;
  }
  if constexpr (C == 0) store_row_stats(a, w, m, total, r, lane);
  store_output(a, w, s, acc, inv, r, C, lane);
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
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  fence_to_wgmma();
  bar_sync(BAR_CONSUMERS, CONSUMER_THREADS);
}

// The key sources: the FP8 cache's 656-byte tokens, or bf16 rows DQK wide, with their consumers and
// the registers (setmaxnreg) of the producer and the two consumer warpgroups, which sum to what the
// launch holds. The FP8 producer holds two batches of tokens (144), beside the split consumers
// (warpgroup 0 holds the scores and half of O: 200, warpgroup 1 half of O: 160); the bf16
// producer's copies need few (96), which leaves room for the seesaw consumers (each holds scores
// and half of O: 200; the first keeps its fp32 scores through its P V to rescale P: 208, it spills
// at 200). ptxas (nvcc 13.0): no spills at these; the split consumers spill with warpgroup 0 at 192
// or warpgroup 1 at 152.
struct Fp8Keys {
  static constexpr bool kFp8 = true;
  static constexpr int kDqk = D_QK;
  static constexpr bool kSeesaw = false;
  static constexpr int kRegs[3] = {144, 200, 160};
};
template <int DQK>
struct Bf16Keys {
  static constexpr bool kFp8 = false;
  static constexpr int kDqk = DQK;
  static constexpr bool kSeesaw = true;
  static constexpr int kRegs[3] = {96, 208, 200};
  static_assert(DQK % BLOCK_COLS == 0 && DQK >= D_V && DQK <= D_QK, "whole column blocks, V inside, fits the stages");
};

// PAIR = 2: the CTAs of head blocks 2i and 2i + 1 form a cluster (launched with cluster dims 2).
template <class Keys, int PAIR>
__global__ void __launch_bounds__(THREADS, 1) attention_kernel(const __grid_constant__ SparseAttentionArgs args) {
  extern __shared__ __align__(128) uint8_t smem[];
  Shared& s = *reinterpret_cast<Shared*>(smem);
  const Work w = work_of(args, Keys::kSeesaw);
  const int rank = w.head_block % PAIR;
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < STAGES; ++stage) {
      Barrier::init(&s.full[stage], PRODUCER_THREADS);
      Barrier::init(&s.empty[stage], CONSUMER_WARPS * PAIR);
      for (int half = 0; half < 2; ++half) {  // the half loaded first also carries the bias (an arrive per thread)
        Barrier::init(&s.half_full[stage][half], PRODUCER_THREADS * (half == first_half(stage) ? 2 : 1));
        Barrier::init(&s.half_empty[stage][half], CONSUMER_WARPS / 2);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (PAIR > 1) cute::cluster_sync();  // the peer's barriers exist before anything reaches them
  else __syncthreads();
  static_assert(WARPGROUP_THREADS * (Keys::kRegs[0] + Keys::kRegs[1] + Keys::kRegs[2]) <= THREADS * LAUNCH_REGS,
                "setmaxnreg budget");
  if (threadIdx.x < PRODUCER_THREADS) {
    cutlass::arch::warpgroup_reg_dealloc<Keys::kRegs[0]>();
    if constexpr (Keys::kFp8) produce_fp8<PAIR>(args, w, s, rank);
    else produce_halves<Keys::kDqk>(args, w, s);
  } else if (threadIdx.x < PRODUCER_THREADS + WARPGROUP_THREADS) {
    cutlass::arch::warpgroup_reg_alloc<Keys::kRegs[1]>();
    load_q<Keys::kDqk>(args, w, s);
    if constexpr (Keys::kSeesaw) seesaw<Keys::kDqk, 0>(args, w, s);
    else score_and_lower_values<Keys::kDqk, PAIR>(args, w, s, rank);
  } else {
    if constexpr (Keys::kRegs[2] > LAUNCH_REGS) cutlass::arch::warpgroup_reg_alloc<Keys::kRegs[2]>();
    else cutlass::arch::warpgroup_reg_dealloc<Keys::kRegs[2]>();
    load_q<Keys::kDqk>(args, w, s);
    if constexpr (Keys::kSeesaw) seesaw<Keys::kDqk, 1>(args, w, s);
    else upper_values<PAIR>(args, w, s, rank);
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
  // (The seesaw's producer reads whole tiles: no pairs.)
  constexpr int kPairs = Keys::kSeesaw ? 1 : 2;
  const bool pair = kPairs == 2 && (args.h_q / HEADS) % 2 == 0 && args.tokens_per_split >= PAIR_MIN_TILES * KEYS;
  const auto kernel = pair ? attention_kernel<Keys, kPairs> : attention_kernel<Keys, 1>;
  cudaError_t err = pair ? opt_in_shared_memory<attention_kernel<Keys, kPairs>>(bytes, device)
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
