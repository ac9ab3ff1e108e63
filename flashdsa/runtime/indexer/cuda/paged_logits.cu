// Paged indexer logits for decode on Hopper (sm_90a): the lightning indexer's scores of a batch's
// query tokens against the FP8 key cache, read once at the pace of memory.
//
// Contract (flashdsa.runtime.indexer.indexer_logits_paged): out[b * n + j, s] = scale[s] *
// sum_h weights[b * n + j, h] * relu(q[b, j, h] . key[s]) for the positions s <= context_lens[b] -
// n + j of request b's cache (found through its block table), -inf for the others below
// max_context_len (with fill_past_context false, the blocks past the context are not written).
// A 64-token cache block holds 64 e4m3 keys of 128 bytes, then their 64 fp32
// scales (8448 bytes, flashdsa.runtime.cache.layout). A block id outside [0, num_blocks) is never
// read: its keys score 0. The block table must map every block of a context (the op's checks);
// entries past it are never read. NaN e4m3 codes score as 0 (relu is fmaxf, as Triton's maximum).
// q and the cache must be 16-byte aligned (cp.async).
//
// One CTA (one warpgroup) takes one request and a run of its cache blocks. Each block's keys and
// scales are copied into a ring of STAGES shared-memory stages with cp.async (16 bytes a copy, the
// keys' chunks placed in wgmma's 128-byte-swizzle layout), STAGES - 1 blocks ahead of the one
// being scored. A block is scored with four m64nNk32 e4m3 wgmmas: its 64 tokens are M, the
// request's queries' heads N (query j's heads at columns j * HP.., padded with zero rows of Q), the
// 128 index dims K, accumulated in fp32 in one run of 128 (the Triton kernel promotes every 128
// too). The epilogue stays in registers: relu, times the head's weight, summed over each query's
// heads in the thread and then across the four lanes of a quad, times the token's scale, masked.
// Several CTAs share an SM (42 KB of shared memory at N = 64), so one CTA's scoring overlaps the
// others' copies in flight.

#include <cstdint>
#include <cuda_runtime.h>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "async_copy.cuh"
#include "paged_logits.h"
#include "shared_memory_opt_in.cuh"
#include "wgmma.cuh"

namespace flashdsa {

namespace {

constexpr int DIM = 128;                 // index head dim: one 128-byte swizzle row of e4m3
constexpr int BLOCK = 64;                // tokens of a cache block: the wgmma's M
constexpr int BLOCK_BYTES = BLOCK * (DIM + 4);
constexpr int KEY_BYTES = BLOCK * DIM;
constexpr int STAGES = 4;
constexpr int THREADS = 128;
constexpr int MAX_BLOCKS_PER_CTA = 64;   // the CTA's block ids are read once into shared memory
constexpr int KEY_COPIES = KEY_BYTES / 16 / THREADS;  // 16-byte copies a thread makes of a block's keys
constexpr int SCALE_COPIES = BLOCK * 4 / 16;          // the block's scales: copies by threads 0..15
static_assert(KEY_COPIES * 16 * THREADS == KEY_BYTES && SCALE_COPIES <= THREADS, "copies of a block");

template <int N>
struct Shared {
  alignas(1024) uint8_t q[N * DIM];                 // B operand: N rows (query j, head h at j * HP + h)
  alignas(1024) uint8_t keys[STAGES][KEY_BYTES];    // A operand: the block's 64 tokens
  float scales[STAGES][BLOCK];
  int ids[MAX_BLOCKS_PER_CTA];
};

template <int N>
struct Mma;
template <>
struct Mma<64> { using type = gmma::MMA_64x64x32_F32E4M3E4M3_SS_TN<>; };
template <>
struct Mma<128> { using type = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>; };
template <>
struct Mma<256> { using type = gmma::MMA_64x256x32_F32E4M3E4M3_SS_TN<>; };

// Copies the CTA's block i (block ids[i], which is live) into stage i % STAGES.
template <int N>
__device__ __forceinline__ void copy_block(const PagedLogitsArgs& a, Shared<N>& s, int i) {
  const int id = s.ids[i];
  const bool ok = id >= 0 && id < a.num_blocks;
  const uint8_t* block = a.cache + static_cast<int64_t>(ok ? id : 0) * BLOCK_BYTES;
  uint8_t* keys = s.keys[i % STAGES];
#pragma unroll
  for (int k = 0; k < KEY_COPIES; ++k) {
    const int chunk = threadIdx.x + THREADS * k;  // row chunk / 8, 16-byte chunk chunk % 8
    copy_async_16(keys + swizzle_128b(chunk >> 3, chunk & 7), block + chunk * 16, ok);
  }
  if (threadIdx.x < SCALE_COPIES)
    copy_async_16(&s.scales[i % STAGES][threadIdx.x * 4], block + KEY_BYTES + threadIdx.x * 16, ok);
}

// -inf into positions [from, to) of the request's n rows.
__device__ __forceinline__ void fill_minus_inf(const PagedLogitsArgs& a, int b, int64_t from, int64_t to) {
  for (int j = 0; j < a.n; ++j) {
    float* row = a.out + (static_cast<int64_t>(b) * a.n + j) * a.max_context_len;
    for (int64_t p = from + threadIdx.x; p < to; p += THREADS) row[p] = -INFINITY;
  }
}

// N: the wgmma's N (query heads of the request, padded); NQ: queries a request (power of two), each
// owning HP = N / NQ columns.
template <int N, int NQ>
__global__ void __launch_bounds__(THREADS) paged_logits_kernel(const __grid_constant__ PagedLogitsArgs a) {
  constexpr int HP = N / NQ;
  constexpr int FRAGS = N / 8;
  static_assert(HP % 8 == 0, "a fragment's 8 columns belong to one query");
  extern __shared__ __align__(1024) uint8_t smem[];  // the swizzle is on absolute addresses
  Shared<N>& s = *reinterpret_cast<Shared<N>*>(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.y;
  const int len = a.context_lens[b];
  const int first = blockIdx.x * a.blocks_per_cta;
  const int width_blocks = static_cast<int>((a.max_context_len + BLOCK - 1) / BLOCK);
  const int end = min(first + a.blocks_per_cta, width_blocks);
  const int live = max(min(end, (len + BLOCK - 1) / BLOCK) - first, 0);  // blocks holding context

  if (tid < live) s.ids[tid] = a.block_tables[b * a.table_stride + first + tid];
  for (int chunk = tid; chunk < N * DIM / 16; chunk += THREADS) {  // Q, zero rows past the heads
    const int row = chunk >> 3, j = row / HP, h = row % HP;
    const bool ok = j < a.n && h < a.heads;
    const uint8_t* src = a.q + ((static_cast<int64_t>(b) * a.n + (ok ? j : 0)) * a.heads + (ok ? h : 0)) * DIM;
    copy_async_16(s.q + swizzle_128b(row, chunk & 7), src + (chunk & 7) * 16, ok);
  }
  float w[FRAGS][2];  // the weights of the thread's accumulator columns
#pragma unroll
  for (int f = 0; f < FRAGS; ++f)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * f + 2 * (lane & 3) + e, j = col / HP, h = col % HP;
      w[f][e] = j < a.n && h < a.heads ? a.weights[(static_cast<int64_t>(b) * a.n + j) * a.heads + h] : 0.0f;
    }
  __syncthreads();  // the block ids
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {  // Q goes with the first group
    if (i < live) copy_block(a, s, i);
    commit_copies();
  }

  using MmaOp = typename Mma<N>::type;
  const int row = warp * 16 + (lane >> 2);  // the thread's tokens in a block: row and row + 8
  for (int i = 0; i < live; ++i) {
    wait_copies<STAGES - 2>();  // block i (and Q) landed
    fence_to_wgmma();
    __syncthreads();  // everyone's copies of block i landed; everyone is done with block i - 1's stage
    if (i + STAGES - 1 < live) copy_block(a, s, i + STAGES - 1);
    commit_copies();

    float acc[FRAGS][4];
    const uint64_t key_desc = sw128_desc(s.keys[i % STAGES], 16, 1024);
    const uint64_t q_desc = sw128_desc(s.q, 16, 1024);
    fence_fragments(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < DIM / 32; ++k)  // 32 bytes of K a step, inside the swizzle row
      wgmma<MmaOp>(key_desc + 2 * k, q_desc + 2 * k, acc, k == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One);
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_fragments(acc);

    float score[NQ][2] = {};
#pragma unroll
    for (int f = 0; f < FRAGS; ++f)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        score[8 * f / HP][0] += fmaxf(acc[f][e], 0.0f) * w[f][e];
        score[8 * f / HP][1] += fmaxf(acc[f][2 + e], 0.0f) * w[f][e];
      }
    const int64_t block_pos = static_cast<int64_t>(first + i) * BLOCK;
#pragma unroll
    for (int j = 0; j < NQ; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float total = quad_sum(score[j][r]) * s.scales[i % STAGES][row + 8 * r];
        const int64_t pos = block_pos + row + 8 * r;
        if ((lane & 3) == j % 4 && j < a.n && pos < a.max_context_len) {
          const bool seen = pos <= len - a.n + j;
          a.out[(static_cast<int64_t>(b) * a.n + j) * a.max_context_len + pos] = seen ? total : -INFINITY;
        }
      }
  }
  wait_copies<0>();
  if (a.fill_past_context)
    fill_minus_inf(a, b, static_cast<int64_t>(first + live) * BLOCK,
                   min(static_cast<int64_t>(end) * BLOCK, a.max_context_len));
}

template <int N, int NQ>
cudaError_t launch(const PagedLogitsArgs& a, int device, cudaStream_t stream) {
  constexpr auto kernel = paged_logits_kernel<N, NQ>;
  const int bytes = static_cast<int>(sizeof(Shared<N>));
  cudaError_t err = opt_in_shared_memory<kernel>(bytes, device);
  if (err != cudaSuccess) return err;
  const int64_t width_blocks = (a.max_context_len + BLOCK - 1) / BLOCK;
  const dim3 grid(static_cast<unsigned>((width_blocks + a.blocks_per_cta - 1) / a.blocks_per_cta),
                  static_cast<unsigned>(a.batch));
  kernel<<<grid, THREADS, bytes, stream>>>(a);
  return cudaGetLastError();
}

// The instance for N columns and nq (1, 2 or 4) queries a request.
template <int N>
cudaError_t launch_columns(const PagedLogitsArgs& a, int nq, int device, cudaStream_t stream) {
  return nq == 1   ? launch<N, 1>(a, device, stream)
         : nq == 2 ? launch<N, 2>(a, device, stream)
                   : launch<N, 4>(a, device, stream);
}

}  // namespace

int paged_logits_max_blocks_per_cta() { return MAX_BLOCKS_PER_CTA; }

int paged_logits_columns(int n, int heads) {
  int nq = 1;
  while (nq < n) nq *= 2;
  for (int cols : {64, 128, 256})
    if (nq <= 4 && cols / nq >= heads && (cols / nq) % 8 == 0) return cols;
  return 0;
}

const char* launch_paged_logits(const PagedLogitsArgs& a, int device, void* stream) {
  if (a.batch == 0 || a.max_context_len == 0) return nullptr;
  const int cols = paged_logits_columns(a.n, a.heads);
  if (cols == 0 || a.blocks_per_cta < 1 || a.blocks_per_cta > MAX_BLOCKS_PER_CTA || a.batch > 65535 ||
      (a.max_context_len + BLOCK - 1) / BLOCK > 0x7fffffff)
    return "paged indexer logits: unsupported queries x heads, blocks_per_cta or batch (the op checks these first)";
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const auto s = static_cast<cudaStream_t>(stream);
  int nq = 1;
  while (nq < a.n) nq *= 2;
  err = cols == 64    ? launch_columns<64>(a, nq, device, s)
        : cols == 128 ? launch_columns<128>(a, nq, device, s)
                      : launch_columns<256>(a, nq, device, s);
  if (previous != device) cudaSetDevice(previous);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace flashdsa
