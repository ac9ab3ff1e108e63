// Sparse MLA backward for Hopper (sm_90a), the dq half: for one query token and 64 heads, over the
// token's top-k key rows in tiles of 32, recompute P = exp2(S sm_scale log2e - lse log2e) from
// S = q k^T (0 on invalid slots), form dP = dout v^T and dS = P (dP - delta) sm_scale with
// delta = rowsum(out * dout), accumulate dq += dS k, and leave P and dS in bf16 scratch
// [token, head, slot] for the dkv half (sparse_bwd_dkv.cu).
//
// Contract (flashdsa.runtime.kernels.sparse_mla_bwd): a slot whose key id is outside [0, s_kv) is
// never read and adds nothing; a row whose lse is +inf (no valid slot) gets dq = 0.
//
// Warp roles (one CTA an SM, 384 threads, setmaxnreg):
//  - producer warpgroup: each tile's 32 key rows (bf16, DQK wide) gathered by id with 16-byte
//    cp.async into one of two stages (zeros for invalid ids), in 64-column blocks of 128-byte
//    swizzled rows;
//  - warpgroup 0: S = q k^T (m64n32k16, q and the keys in shared memory), P in registers, then dq's
//    columns 0..255 (m64n256k16, dS from registers, the key rows MN-major);
//  - warpgroup 1: dP = dout v^T (m64n32k16) at the same time, then dq's columns 256..DQK - 1.
// The two swap P and dP through shared memory (fp32, by accumulator fragment: both hold the same
// elements), so each forms the same dS in registers for its own dq columns; warpgroup 0 writes P
// to scratch, warpgroup 1 dS. q and dout (64 heads) stay in shared memory for the whole list.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "async_copy.cuh"
#include "copy_ring.cuh"
#include "fast_math.cuh"
#include "launch_on_device.cuh"
#include "named_barriers.cuh"
#include "shared_memory_opt_in.cuh"
#include "sparse_bwd.h"
#include "wgmma.cuh"

namespace flashdsa {
namespace {

constexpr int HEADS = 64;                      // query heads of a CTA: wgmma's M
constexpr int KEYS = kSparseBwdDqKeysPerTile;  // keys of a tile: N of the score wgmmas, K of dq's
constexpr int STAGES = 2;
constexpr int MAX_DQK = 576;
constexpr int D_V = 512;
constexpr int BLOCK_COLS = 64;                 // bf16 columns of a 128-byte swizzle row
constexpr int HEAD_BLOCK_BYTES = HEADS * 128;  // a column block of q or dout
constexpr int KEY_BLOCK_BYTES = KEYS * 128;    // a column block of a key tile
constexpr int WARPGROUP_THREADS = 128;
constexpr int THREADS = 3 * WARPGROUP_THREADS;
constexpr int CONSUMER_THREADS = 2 * WARPGROUP_THREADS;
constexpr int S_TILES = KEYS / 8;              // accumulator fragments of a 64 x 32 score tile
constexpr int LOW_COLS = 256;                  // dq columns of warpgroup 0; warpgroup 1 has the rest
constexpr int PRODUCER_REGS = 56;
constexpr int LOW_REGS = 208;   // dq 64 x 256 fp32 (128) beside the scores
constexpr int HIGH_REGS = 216;  // dq 64 x 320 fp32 (160) beside dP
static_assert(WARPGROUP_THREADS * (PRODUCER_REGS + LOW_REGS + HIGH_REGS) <= THREADS * 168,
              "setmaxnreg budget: the registers the launch holds (168 a thread at 384 threads)");
constexpr float LOG2E = 1.4426950408889634f;

// Named barriers among the consumer warpgroups: q, dout and delta loaded; this tile's P and dP
// written; the last tile's read (the exchange buffer may be overwritten).
constexpr int BAR_LOADED = 1;
constexpr int BAR_EXCHANGED = 2;
constexpr int BAR_EXCHANGE_FREE = 3;

using Barrier = cutlass::arch::ClusterBarrier;

struct Shared {
  alignas(1024) uint8_t q[MAX_DQK / BLOCK_COLS][HEAD_BLOCK_BYTES];        // the CTA's 64 query rows
  alignas(1024) uint8_t dout[D_V / BLOCK_COLS][HEAD_BLOCK_BYTES];         // and their output gradients
  alignas(1024) uint8_t k[STAGES][MAX_DQK / BLOCK_COLS][KEY_BLOCK_BYTES]; // key rows; columns < 512 are v
  float exchange[2][HEADS * KEYS];  // the tile's P (warpgroup 0) and dP (warpgroup 1), by fragment
  float delta[HEADS];               // rowsum(out * dout)
  float lse2[HEADS];                // lse in base 2
  uint64_t full[STAGES];            // the stage's key rows are in place (the producers arrive)
  uint64_t empty[STAGES];           // both consumer warpgroups are done with it (every warp arrives)
};
static_assert(sizeof(Shared) <= 227 * 1024, "one CTA per SM: at most 227 KB of shared memory");

using ScoreMma = gmma::MMA_64x32x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
using DqMma = gmma::MMA_64x256x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;      // dS from registers
using RopeDqMma = gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;   // columns 512..575

// Descriptor offsets (16-byte units) of K step kk (16 columns) of a K-major operand whose 64-column
// blocks are block_bytes apart.
__device__ __forceinline__ uint64_t k_step(int kk, int block_bytes) {
  return static_cast<uint64_t>((kk / 4) * block_bytes + (kk % 4) * 32) >> 4;
}

// The producer warpgroup: each tile's 32 key rows, gathered by id (zeros for an invalid id, which
// is never read), into the ring (copy_ring.cuh's produce_ring). Warp w copies keys 8w..8w + 7, a
// key's 16-byte chunks across its lanes; lane l holds key 8w + l % 8's id, loaded one tile ahead
// and passed round by shuffle, so no copy waits on a load of its id.
template <int DQK>
__device__ void produce(const SparseBwdDqArgs& a, Shared& s, int64_t token, int tiles) {
  constexpr int CHUNKS = DQK / 8;  // 16-byte chunks of a key row
  constexpr int KEYS_PER_WARP = KEYS / 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t* ids = a.indices + token * a.topk + KEYS_PER_WARP * warp + lane % KEYS_PER_WARP;
  const __nv_bfloat16* kv = static_cast<const __nv_bfloat16*>(a.kv);
  int next = __ldg(ids);
  produce_ring<STAGES>(s.full, s.empty, tiles, [&](int t, int stage) {
    const int id = next >= 0 && next < a.s_kv ? next : -1;
    if (t + 1 < tiles) next = __ldg(ids + (t + 1) * KEYS);
#pragma unroll
    for (int k = 0; k < KEYS_PER_WARP; ++k) {
      const int key = KEYS_PER_WARP * warp + k, key_id = __shfl_sync(0xffffffffu, id, k);
      const __nv_bfloat16* row = kv + static_cast<int64_t>(key_id < 0 ? 0 : key_id) * DQK;
#pragma unroll
      for (int chunk = lane; chunk < CHUNKS; chunk += 32)
        copy_async_16(s.k[stage][chunk / 8] + swizzle_128b(key, chunk % 8), row + chunk * 8, key_id >= 0);
    }
  });
}

// Both consumer warpgroups: the CTA's q (DQK columns) and dout rows into shared memory (cp.async),
// delta and lse (base 2) of its 64 heads; then a barrier among them.
template <int DQK>
__device__ void load_rows(const SparseBwdDqArgs& a, Shared& s, int64_t token, int head0) {
  const int tid = threadIdx.x - WARPGROUP_THREADS;
  const int64_t row0 = token * a.h_q + head0;
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q) + row0 * DQK;
  const __nv_bfloat16* dout = static_cast<const __nv_bfloat16*>(a.dout) + row0 * D_V;
  const __nv_bfloat16* out = static_cast<const __nv_bfloat16*>(a.out) + row0 * D_V;
  copy_rows_swizzled(s.q[0], HEAD_BLOCK_BYTES, q, DQK, HEADS, DQK / 8, tid, CONSUMER_THREADS);
  copy_rows_swizzled(s.dout[0], HEAD_BLOCK_BYTES, dout, D_V, HEADS, D_V / 8, tid, CONSUMER_THREADS);
  commit_copies();
  // delta: four threads a head (a quad), 128 columns each, 8 at a time
  const int head = tid / 4, part = tid % 4;
  float sum = 0.0f;
#pragma unroll 4
  for (int c = part * 8; c < D_V; c += 32) {
    const uint4 o = *reinterpret_cast<const uint4*>(out + head * D_V + c);
    const uint4 d = *reinterpret_cast<const uint4*>(dout + head * D_V + c);
    const __nv_bfloat162* ov = reinterpret_cast<const __nv_bfloat162*>(&o);
    const __nv_bfloat162* dv = reinterpret_cast<const __nv_bfloat162*>(&d);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 of = __bfloat1622float2(ov[i]), df = __bfloat1622float2(dv[i]);
      sum += of.x * df.x + of.y * df.y;
    }
  }
  sum = quad_sum(sum);
  if (part == 0) {
    s.delta[head] = sum;
    s.lse2[head] = a.lse[row0 + head] * LOG2E;
  }
  wait_copies<0>();
  fence_to_wgmma();
  bar_sync(BAR_LOADED, CONSUMER_THREADS);
}

// Element (warp r, fragment j, entry e, lane) of a 64 x 32 accumulator in the exchange buffer:
// consecutive lanes, consecutive words.
__device__ __forceinline__ int exchange_at(int r, int j, int e, int lane) {
  return ((r * S_TILES + j) * 4 + e) * 32 + lane;
}

// This warpgroup's half of the swap (mine into buffer `own`), then the other half's values; the
// buffer is free again once both have read (the next tile's first barrier).
__device__ __forceinline__ void swap_with_peer(Shared& s, int t, int own, const float (&mine)[S_TILES][4],
                                               float (&theirs)[S_TILES][4], int r, int lane) {
  if (t > 0) bar_sync(BAR_EXCHANGE_FREE, CONSUMER_THREADS);
#pragma unroll
  for (int j = 0; j < S_TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s.exchange[own][exchange_at(r, j, e, lane)] = mine[j][e];
  bar_sync(BAR_EXCHANGED, CONSUMER_THREADS);
#pragma unroll
  for (int j = 0; j < S_TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) theirs[j][e] = s.exchange[own ^ 1][exchange_at(r, j, e, lane)];
}

// dS = P (dP - delta) sm_scale for rows g, g + 8 of warp r, packed as wgmma A fragments
// (ds[j][0]: row g, keys 8j + 2t4 (+1); ds[j][1]: row g + 8); the tile's bf16 values of `keep`
// (P or dS, fp32) go to scratch at [token, head, slot].
__device__ __forceinline__ void form_ds(const SparseBwdDqArgs& a, const Shared& s, const float (&p)[S_TILES][4],
                                        const float (&dp)[S_TILES][4], uint32_t (&ds)[S_TILES][2], bool keep_p,
                                        int64_t local, int head0, int t, int r, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const float delta[2] = {s.delta[16 * r + g], s.delta[16 * r + g + 8]};
  __nv_bfloat16* scratch = static_cast<__nv_bfloat16*>(keep_p ? a.p : a.ds);
#pragma unroll
  for (int j = 0; j < S_TILES; ++j) {
    float d[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] = p[j][e] * (dp[j][e] - delta[e >> 1]) * a.sm_scale;
    ds[j][0] = pack_bf16(d[0], d[1]);
    ds[j][1] = pack_bf16(d[2], d[3]);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t row = local * a.h_q + head0 + 16 * r + g + 8 * i;
      const uint32_t value = keep_p ? pack_bf16(p[j][2 * i], p[j][2 * i + 1]) : ds[j][i];
      *reinterpret_cast<uint32_t*>(scratch + row * a.topk + t * KEYS + 8 * j + 2 * t4) = value;
    }
  }
}

// m64n32 scores of the tile: A (q or dout) from shared memory over STEPS K steps of 16 columns.
template <int STEPS>
__device__ __forceinline__ void score_tile(const uint8_t* a_rows, const uint8_t* keys, float (&acc)[S_TILES][4]) {
  const uint64_t a_desc = sw128_desc(a_rows, 16, 1024), b_desc = sw128_desc(keys, 16, 1024);
  fence_fragments(acc);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < STEPS; ++kk)
    wgmma<ScoreMma>(a_desc + k_step(kk, HEAD_BLOCK_BYTES), b_desc + k_step(kk, KEY_BLOCK_BYTES), acc,
                    kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One);
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  fence_fragments(acc);
}

// acc += dS k over the tile's 32 keys for the N columns of key-row block `block` on (MN-major B).
template <typename Mma, int N>
__device__ __forceinline__ void add_dq(const uint32_t (&ds)[S_TILES][2], const uint8_t* first_block,
                                       float (&acc)[N][4]) {
  const uint64_t desc = sw128_desc(first_block, KEY_BLOCK_BYTES, 1024);
#pragma unroll
  for (int ks = 0; ks < KEYS / 16; ++ks)
    wgmma_rs<Mma>({ds[2 * ks][0], ds[2 * ks][1], ds[2 * ks + 1][0], ds[2 * ks + 1][1]}, desc + ks * 128, acc);
}

// dq's columns col0.. of rows g, g + 8 of warp r (bf16, 4 bytes a store).
template <int N>
__device__ __forceinline__ void store_dq(const SparseBwdDqArgs& a, const float (&acc)[N][4], int64_t token, int head0,
                                         int col0, int dqk, int r, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  __nv_bfloat16* dq = static_cast<__nv_bfloat16*>(a.dq);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    __nv_bfloat16* row = dq + (token * a.h_q + head0 + 16 * r + g + 8 * i) * dqk + col0 + 2 * t4;
#pragma unroll
    for (int j = 0; j < N; ++j) *reinterpret_cast<uint32_t*>(row + 8 * j) = pack_bf16(acc[j][2 * i], acc[j][2 * i + 1]);
  }
}

// Hands the stage back once this warp's wgmma reads of it are done.
__device__ __forceinline__ void release_stage(Shared& s, int stage) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) Barrier::arrive(&s.empty[stage]);
}

// Warpgroup 0: scores, P, the swap, dS, dq columns 0..255.
template <int DQK>
__device__ void low_half(const SparseBwdDqArgs& a, Shared& s, int64_t local, int64_t token, int head0, int tiles) {
  const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) % 4, g = lane >> 2, t4 = lane & 3;
  const float scale_log2 = a.sm_scale * LOG2E;
  const float lse2[2] = {s.lse2[16 * r + g], s.lse2[16 * r + g + 8]};
  const int32_t* ids = a.indices + token * a.topk;
  float acc[LOW_COLS / 8][4];
#pragma unroll
  for (int n = 0; n < LOW_COLS / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  for (int t = 0; t < tiles; ++t) {
    const int stage = t % STAGES;
    int2 id[S_TILES];  // this thread's keys' ids, loaded while the scores are computed
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) id[j] = __ldg(reinterpret_cast<const int2*>(ids + t * KEYS + 8 * j + 2 * t4));
    Barrier::wait(&s.full[stage], (t / STAGES) & 1);
    float p[S_TILES][4], dp[S_TILES][4];
    score_tile<DQK / 16>(s.q[0], s.k[stage][0], p);
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) {
      const bool valid[2] = {id[j].x >= 0 && id[j].x < a.s_kv, id[j].y >= 0 && id[j].y < a.s_kv};
#pragma unroll
      for (int e = 0; e < 4; ++e) p[j][e] = valid[e & 1] ? exp2_approx(p[j][e] * scale_log2 - lse2[e >> 1]) : 0.0f;
    }
    swap_with_peer(s, t, 0, p, dp, r, lane);
    uint32_t ds[S_TILES][2];
    form_ds(a, s, p, dp, ds, true, local, head0, t, r, lane);
    fence_fragments(acc);
    cute::warpgroup_arrive();
    add_dq<DqMma>(ds, s.k[stage][0], acc);
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_fragments(acc);
    release_stage(s, stage);
  }
  store_dq(a, acc, token, head0, 0, DQK, r, lane);
}

// Warpgroup 1: dP, the swap, dS, dq columns 256..DQK - 1 (256..511 and, for 576, 512..575).
template <int DQK>
__device__ void high_half(const SparseBwdDqArgs& a, Shared& s, int64_t local, int64_t token, int head0, int tiles) {
  const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) % 4;
  constexpr int ROPE_COLS = DQK - D_V;
  float acc[(D_V - LOW_COLS) / 8][4];
  float rope[ROPE_COLS > 0 ? ROPE_COLS / 8 : 1][4];
#pragma unroll
  for (int n = 0; n < (D_V - LOW_COLS) / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
  for (int n = 0; n < (ROPE_COLS > 0 ? ROPE_COLS / 8 : 1); ++n)
    rope[n][0] = rope[n][1] = rope[n][2] = rope[n][3] = 0.0f;
  for (int t = 0; t < tiles; ++t) {
    const int stage = t % STAGES;
    Barrier::wait(&s.full[stage], (t / STAGES) & 1);
    float dp[S_TILES][4], p[S_TILES][4];
    score_tile<D_V / 16>(s.dout[0], s.k[stage][0], dp);
    swap_with_peer(s, t, 1, dp, p, r, lane);
    uint32_t ds[S_TILES][2];
    form_ds(a, s, p, dp, ds, false, local, head0, t, r, lane);
    fence_fragments(acc);
    if constexpr (ROPE_COLS > 0) fence_fragments(rope);
    cute::warpgroup_arrive();
    add_dq<DqMma>(ds, s.k[stage][LOW_COLS / BLOCK_COLS], acc);
    if constexpr (ROPE_COLS > 0) add_dq<RopeDqMma>(ds, s.k[stage][D_V / BLOCK_COLS], rope);
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_fragments(acc);
    if constexpr (ROPE_COLS > 0) fence_fragments(rope);
    release_stage(s, stage);
  }
  store_dq(a, acc, token, head0, LOW_COLS, DQK, r, lane);
  if constexpr (ROPE_COLS > 0) store_dq(a, rope, token, head0, D_V, DQK, r, lane);
}

// One CTA per token of the chunk and block of 64 heads, the head blocks of a token next to each other
// (blockIdx.x = token * head blocks + block): both gather the same key rows, the second from L2.
template <int DQK>
__global__ void __launch_bounds__(THREADS, 1) dq_kernel(const __grid_constant__ SparseBwdDqArgs args) {
  static_assert((DQK == 512 || DQK == 576) && KEYS % 16 == 0, "d_qk 512 or 576; whole K steps of 16 keys");
  extern __shared__ __align__(1024) uint8_t smem[];
  Shared& s = *reinterpret_cast<Shared*>(smem);
  const int head_blocks = args.h_q / HEADS;
  const int64_t local = blockIdx.x / head_blocks, token = args.token0 + local;
  const int head0 = static_cast<int>(blockIdx.x % head_blocks) * HEADS;
  const int tiles = args.topk / KEYS;
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < STAGES; ++stage) {
      Barrier::init(&s.full[stage], WARPGROUP_THREADS);
      Barrier::init(&s.empty[stage], CONSUMER_THREADS / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < WARPGROUP_THREADS) {
    cutlass::arch::warpgroup_reg_dealloc<PRODUCER_REGS>();
    produce<DQK>(args, s, token, tiles);
  } else if (threadIdx.x < 2 * WARPGROUP_THREADS) {
    cutlass::arch::warpgroup_reg_alloc<LOW_REGS>();
    load_rows<DQK>(args, s, token, head0);
    low_half<DQK>(args, s, local, token, head0, tiles);
  } else {
    cutlass::arch::warpgroup_reg_alloc<HIGH_REGS>();
    load_rows<DQK>(args, s, token, head0);
    high_half<DQK>(args, s, local, token, head0, tiles);
  }
}

template <int DQK>
cudaError_t launch(const SparseBwdDqArgs& a, int device, cudaStream_t stream) {
  const int bytes = sizeof(Shared);
  cudaError_t err = opt_in_shared_memory<dq_kernel<DQK>>(bytes, device);
  if (err != cudaSuccess) return err;
  dq_kernel<DQK><<<static_cast<unsigned>(a.tokens * (a.h_q / HEADS)), THREADS, bytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

const char* launch_sparse_bwd_dq(const SparseBwdDqArgs& args, int device, void* stream) {
  if (args.tokens == 0) return nullptr;
  if (!sparse_bwd_serves(args.h_q, args.d_qk, args.topk, KEYS, args.tokens * (args.h_q / HEADS)))
    return "sparse bwd dq: unsupported h_q, d_qk, topk or token count (the op checks these first)";
  const auto s = static_cast<cudaStream_t>(stream);
  return launch_on_device(device, [&] {
    return args.d_qk == 576 ? launch<576>(args, device, s) : launch<512>(args, device, s);
  });
}

}  // namespace flashdsa
