// Sparse MLA backward for Hopper (sm_90a), the dkv half: for each query token and selected key slot,
// dkv[key] += dS^T q (every column: the key) + P^T dout (the first 512 columns: the value), summed over
// the token's heads, from the P and dS = P (dP - delta) sm_scale that the dq step (sparse_bwd_dq.cu,
// or Triton's flashdsa.runtime.kernels.triton.sparse_bwd) leaves in bf16 scratch, [token, head, slot].
//
// Contract (flashdsa.runtime.kernels.sparse_mla_bwd): a slot whose key id is outside [0, s_kv) adds
// nothing; duplicates add once per occurrence. Atomic mode adds fp32 rows into dkv with vector
// reductions (red.global.add.v2.f32: the order of the additions varies run to run); deterministic
// mode stores each (token, slot) row and the caller sums them in a fixed order.
//
// One CTA takes one token and a range of N_QK d_qk columns (576 = 3 x 192; 512 = 192 + 192 + 128),
// the token's whole top-k list in tiles of 64 slots:
//  - q's and dout's columns of the range, every head, are loaded once into shared memory (heads as
//    rows, 64-column blocks of 128-byte swizzled rows);
//  - a producer warpgroup copies each tile's dS and P ([heads, 64 slots] bf16, one 128-byte row a
//    head) into a ring of STAGES stages with cp.async;
//  - two consumer warpgroups take alternate tiles: m64nN_QKk16 wgmmas over the heads with both
//    operands MN-major in shared memory give the tile's 64 x N_QK rows (A = dS^T: slots are M;
//    B = q: columns are N), then P^T dout adds the value columns (N_V of them), and the warpgroup
//    hands the stage back and reduces its rows into dkv while the other warpgroup multiplies.
// The heads are wgmma's K: 64 or 128, 4 or 8 steps of 16 per operand pair.

#include <cstdint>
#include <utility>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "async_copy.cuh"
#include "copy_ring.cuh"
#include "launch_on_device.cuh"
#include "shared_memory_opt_in.cuh"
#include "sparse_bwd.h"
#include "wgmma.cuh"

namespace flashdsa {
namespace {

constexpr int SLOTS = kSparseBwdSlotsPerTile;  // key slots of a tile: wgmma's M
constexpr int STAGES = 3;
constexpr int MAX_HEADS = 128;
constexpr int MAX_COLS = 192;                  // d_qk columns of a CTA: wgmma's N
constexpr int D_V = 512;
constexpr int BLOCK_COLS = 64;                 // bf16 columns of one 128-byte swizzle row
constexpr int BLOCK_BYTES = MAX_HEADS * 128;   // a column block: one 128-byte row a head
constexpr int WARPGROUP_THREADS = 128;
constexpr int CONSUMER_GROUPS = 2;
constexpr int THREADS = WARPGROUP_THREADS * (1 + CONSUMER_GROUPS);
using Barrier = cutlass::arch::ClusterBarrier;

struct Shared {
  alignas(1024) uint8_t q[MAX_COLS / BLOCK_COLS][BLOCK_BYTES];     // q's columns of the CTA's range
  alignas(1024) uint8_t dout[MAX_COLS / BLOCK_COLS][BLOCK_BYTES];  // dout's (the value columns among them)
  alignas(1024) uint8_t ds[STAGES][BLOCK_BYTES];                   // a tile's dS: heads as rows, slots as columns
  alignas(1024) uint8_t p[STAGES][BLOCK_BYTES];                    // and its P
  uint64_t full[STAGES];   // the stage's dS and P are in place (the producers arrive)
  uint64_t empty[STAGES];  // the consumer warpgroup that took the stage is done reading it
};
static_assert(sizeof(Shared) <= 227 * 1024, "one CTA per SM: at most 227 KB of shared memory");

// The wgmma of a tile's N columns: A (dS^T or P^T) and B (q or dout) both MN-major in shared memory.
template <int N>
struct TileMma;
template <>
struct TileMma<192> {
  using type = gmma::MMA_64x192x16_F32BF16BF16_SS<gmma::Major::MN, gmma::Major::MN>;
};
template <>
struct TileMma<128> {
  using type = gmma::MMA_64x128x16_F32BF16BF16_SS<gmma::Major::MN, gmma::Major::MN>;
};
template <>
struct TileMma<64> {
  using type = gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::MN, gmma::Major::MN>;
};

// acc's fragments FIRST.. += A B over the N columns of B from column FIRST * 8 on (one wgmma of TileMma<N>).
template <int N, int FIRST, int ACC>
__device__ __forceinline__ void tile_wgmma(uint64_t a, uint64_t b, float (&acc)[ACC][4], gmma::ScaleOut scale) {
  constexpr uint64_t skip = FIRST * 8 / BLOCK_COLS * (BLOCK_BYTES >> 4);  // whole column blocks of B
  wgmma_fragments<typename TileMma<N>::type, FIRST>(a, b + skip, acc, scale, std::make_index_sequence<4 * (N / 8)>{});
}

// dkv[row, col..col + 1] += (x, y), one vector reduction at L2.
__device__ __forceinline__ void reduce_pair(float* at, float x, float y) {
  asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(at), "f"(x), "f"(y) : "memory");
}

// q's columns [col0, col0 + N_QK) and dout's [col0, col0 + N_V) of the token, every head, into shared
// memory by all threads (16-byte cp.async, all in flight at once), fenced for wgmma.
template <int HEADS, int N_QK, int N_V>
__device__ __forceinline__ void load_columns(const SparseBwdDkvArgs& a, Shared& s, int64_t token, int col0) {
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q) + token * HEADS * a.d_qk + col0;
  const __nv_bfloat16* dout = static_cast<const __nv_bfloat16*>(a.dout) + token * HEADS * D_V + col0;
  copy_rows_swizzled(s.q[0], BLOCK_BYTES, q, a.d_qk, HEADS, N_QK / 8, threadIdx.x, THREADS);
  copy_rows_swizzled(s.dout[0], BLOCK_BYTES, dout, D_V, HEADS, N_V / 8, threadIdx.x, THREADS);
  commit_copies();
  wait_copies<0>();
  fence_to_wgmma();
}

// The producer warpgroup: each tile's dS and P rows (64 slots of every head, 128 bytes a head) into
// the ring (copy_ring.cuh's produce_ring).
template <int HEADS>
__device__ void produce(const SparseBwdDkvArgs& a, Shared& s, int64_t local, int tiles) {
  const int64_t first = local * HEADS * a.topk;  // the token's rows of scratch
  const __nv_bfloat16* ds = static_cast<const __nv_bfloat16*>(a.ds) + first;
  const __nv_bfloat16* p = static_cast<const __nv_bfloat16*>(a.p) + first;
  produce_ring<STAGES>(s.full, s.empty, tiles, [&](int t, int stage) {
    copy_rows_swizzled(s.ds[stage], BLOCK_BYTES, ds + t * SLOTS, a.topk, HEADS, 8, threadIdx.x, WARPGROUP_THREADS);
    copy_rows_swizzled(s.p[stage], BLOCK_BYTES, p + t * SLOTS, a.topk, HEADS, 8, threadIdx.x, WARPGROUP_THREADS);
  });
}

// The dkv rows of this thread's accumulator rows in tile t (slots 16 * warp + g and + 8): the key
// ids (-1 when invalid: skipped), or the (token, slot) rows of deterministic mode. Read while the
// tile's wgmmas run.
__device__ __forceinline__ void rows_of(const SparseBwdDkvArgs& a, int64_t local, int t, int warp, int lane,
                                        int (&rows)[2]) {
  const int64_t token = a.token0 + local;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int slot = t * SLOTS + 16 * warp + (lane >> 2) + 8 * i;
    if (a.deterministic) {
      rows[i] = static_cast<int>(local * a.topk + slot);  // the chunk's scratch rows fit an int (the op checks)
    } else {
      const int id = __ldg(a.indices + token * a.topk + slot);
      rows[i] = id >= 0 && id < a.s_kv ? id : -1;
    }
  }
}

// The tile's rows into dkv: added to the selected key rows, or stored (deterministic mode).
template <int N_QK>
__device__ __forceinline__ void write_rows(const SparseBwdDkvArgs& a, const float (&acc)[N_QK / 8][4],
                                           const int (&rows)[2], int col0, int lane) {
  const int t4 = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t row = rows[i];
    if (row < 0) continue;
    float* out = a.dkv + row * a.d_qk + col0 + 2 * t4;
#pragma unroll
    for (int j = 0; j < N_QK / 8; ++j) {
      if (a.deterministic) *reinterpret_cast<float2*>(out + 8 * j) = make_float2(acc[j][2 * i], acc[j][2 * i + 1]);
      else reduce_pair(out + 8 * j, acc[j][2 * i], acc[j][2 * i + 1]);
    }
  }
}

// Consumer warpgroup `group`: tiles group, group + 2, ...: acc = dS^T q over the heads (all N_QK
// columns), += P^T dout over the first N_V, then the stage goes back and the rows go out.
// A wgmma batch may write one accumulator register with wgmmas of one shape only (PTX: other mixes
// need a wgmma.fence between them, which serializes the batch), so with N_V < N_QK the key product
// runs as N_V columns (the value product's shape, on the same fragments) plus the other N_QK - N_V.
template <int HEADS, int N_QK, int N_V>
__device__ void consume(const SparseBwdDkvArgs& a, Shared& s, int64_t local, int tiles, int col0, int group) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % 4;
  // MN-major descriptors: leading byte offset = the stride between 64-column blocks, stride = 1024
  // bytes between groups of 8 rows (heads) along K; a K step of 16 heads is 2048 bytes (128 units)
  const uint64_t q_desc = sw128_desc(s.q[0], BLOCK_BYTES, 1024);
  const uint64_t dout_desc = sw128_desc(s.dout[0], BLOCK_BYTES, 1024);
  float acc[N_QK / 8][4];
  for (int t = group; t < tiles; t += CONSUMER_GROUPS) {
    const int stage = t % STAGES;
    const uint64_t ds_desc = sw128_desc(s.ds[stage], BLOCK_BYTES, 1024);
    const uint64_t p_desc = sw128_desc(s.p[stage], BLOCK_BYTES, 1024);
    Barrier::wait(&s.full[stage], (t / STAGES) & 1);
    fence_fragments(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < HEADS / 16; ++kk) {
      const gmma::ScaleOut scale = kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One;
      tile_wgmma<N_V, 0>(ds_desc + kk * 128, q_desc + kk * 128, acc, scale);
      if constexpr (N_V < N_QK) tile_wgmma<N_QK - N_V, N_V / 8>(ds_desc + kk * 128, q_desc + kk * 128, acc, scale);
    }
#pragma unroll
    for (int kk = 0; kk < HEADS / 16; ++kk)  // the first N_V columns (fragments) only
      tile_wgmma<N_V, 0>(p_desc + kk * 128, dout_desc + kk * 128, acc, gmma::ScaleOut::One);
    cute::warpgroup_commit_batch();
    int rows[2];
    rows_of(a, local, t, warp, lane, rows);
    cute::warpgroup_wait<0>();
    fence_fragments(acc);
    __syncwarp();
    if (lane == 0) Barrier::arrive(&s.empty[stage]);
    write_rows<N_QK>(a, acc, rows, col0, lane);
  }
}

// One CTA per token of the chunk (blockIdx.x) and N_QK-column range col_base + N_QK * blockIdx.y.
template <int HEADS, int N_QK, int N_V>
__global__ void __launch_bounds__(THREADS, 1) dkv_kernel(const __grid_constant__ SparseBwdDkvArgs args, int col_base) {
  static_assert(HEADS % 16 == 0 && HEADS <= MAX_HEADS && N_QK <= MAX_COLS && N_V <= N_QK && N_QK % BLOCK_COLS == 0 &&
                    N_V % BLOCK_COLS == 0,
                "wgmma K steps of 16 heads; the range's column blocks fit the buffers");
  extern __shared__ __align__(1024) uint8_t smem[];
  Shared& s = *reinterpret_cast<Shared*>(smem);
  const int64_t local = blockIdx.x;
  const int col0 = col_base + N_QK * static_cast<int>(blockIdx.y);
  const int tiles = args.topk / SLOTS;
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < STAGES; ++stage) {
      Barrier::init(&s.full[stage], WARPGROUP_THREADS);
      Barrier::init(&s.empty[stage], WARPGROUP_THREADS / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  load_columns<HEADS, N_QK, N_V>(args, s, args.token0 + local, col0);
  __syncthreads();  // the barriers exist; q's and dout's columns are in place
  const int group = static_cast<int>(threadIdx.x) / WARPGROUP_THREADS;
  if (group == 0) produce<HEADS>(args, s, local, tiles);
  else consume<HEADS, N_QK, N_V>(args, s, local, tiles, col0, group - 1);
}

template <int HEADS, int N_QK, int N_V>
cudaError_t launch_range(const SparseBwdDkvArgs& a, int col_base, unsigned ranges, int device, cudaStream_t stream) {
  const int bytes = sizeof(Shared);
  cudaError_t err = opt_in_shared_memory<dkv_kernel<HEADS, N_QK, N_V>>(bytes, device);
  if (err != cudaSuccess) return err;
  dkv_kernel<HEADS, N_QK, N_V><<<dim3(static_cast<unsigned>(a.tokens), ranges), THREADS, bytes, stream>>>(a, col_base);
  return cudaGetLastError();
}

// Columns 0..383 as two 192-wide ranges, then 384..d_qk - 1: 192 wide (128 of them value) for 576,
// 128 for 512.
template <int HEADS>
cudaError_t launch_heads(const SparseBwdDkvArgs& a, int device, cudaStream_t stream) {
  cudaError_t err = launch_range<HEADS, 192, 192>(a, 0, 2, device, stream);
  if (err != cudaSuccess) return err;
  return a.d_qk == 576 ? launch_range<HEADS, 192, 128>(a, 384, 1, device, stream)
                       : launch_range<HEADS, 128, 128>(a, 384, 1, device, stream);
}

}  // namespace

const char* launch_sparse_bwd_dkv(const SparseBwdDkvArgs& args, int device, void* stream) {
  if (args.tokens == 0) return nullptr;
  if (!sparse_bwd_serves(args.h_q, args.d_qk, args.topk, SLOTS, args.tokens))
    return "sparse bwd dkv: unsupported h_q, d_qk, topk or token count (the op checks these first)";
  const auto s = static_cast<cudaStream_t>(stream);
  return launch_on_device(device, [&] {
    return args.h_q == 128 ? launch_heads<128>(args, device, s) : launch_heads<64>(args, device, s);
  });
}

}  // namespace flashdsa
