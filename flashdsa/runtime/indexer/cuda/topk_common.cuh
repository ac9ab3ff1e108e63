// Pieces shared by the indexer top-k kernels (topk.cu: one CTA streams a row; topk_cluster.cu: a
// cluster of CTAs holds a row in shared memory): order keys, masked loads, block scans, the radix
// digit pick and the final sort.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>
#include <cub/block/block_radix_sort.cuh>

namespace flashdsa {
namespace {

constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr int VEC = 4;            // scores per 128-bit load
constexpr int MAX_TOPK = 2048;    // the selection is held and sorted in shared memory
constexpr int BINS = 2048;        // 11-bit digits
constexpr int LEVELS = 3;
constexpr int MAX_CLUSTER = 8;    // CTAs per row in topk_cluster.cu (the portable cluster size)
// key digits, most significant first: bits [21, 32), [10, 21), [0, 10)
__host__ __device__ constexpr int shift_of(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
__host__ __device__ constexpr int bits_of(int level) { return level == 2 ? 10 : 11; }
constexpr int SORT_ITEMS = MAX_TOPK / THREADS;

using Sort = cub::BlockRadixSort<uint32_t, THREADS, SORT_ITEMS, int>;

// The bin picked by pick_digit: digit, entries in higher bins (above), in it (count), and the
// number wanted (need, capped at the entries).
struct Digit {
  int digit, above, count, need;
};

// Block-wide scratch of the scans and the digit pick.
struct Scratch {
  ulonglong2 warp_sums[WARPS];
  Digit pick;
};

// fp32 -> uint32 whose unsigned order is the float order; -0.0 maps with +0.0 (a tie). Every finite
// score's key is >= 0x00800000 (-FLT_MAX's), so key 0 marks a score that can never be selected.
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ bool is_finite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// Keys of columns p .. p + VEC - 1 of `row` (width columns, p a multiple of VEC from a 16-byte
// aligned column): 0 outside [lo, hi) or not finite. One 128-bit load inside the row; columns
// outside [lo, hi) are never read on the scalar path (p may be below 0 or past the row there).
__device__ __forceinline__ void load_keys(const float* row, int p, int lo, int hi, int width, uint32_t (&key)[VEC]) {
  float v[VEC];
  if (p >= 0 && p + VEC <= width && p < hi) {
    const float4 q = *reinterpret_cast<const float4*>(row + p);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = (p + i < hi && p + i >= lo) ? row[p + i] : __int_as_float(0x7f800000);
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) key[i] = p + i >= lo && p + i < hi && is_finite(v[i]) ? order_key(v[i]) : 0u;
}

// The first column to load from: at or below lo, where the row's address is 16-byte aligned (fp32
// rows are 4-byte aligned, so some column among lo - 3 .. lo is).
__host__ __device__ __forceinline__ int first_aligned_column(const float* row, int lo) {
  const int misaligned = static_cast<int>(reinterpret_cast<uintptr_t>(row) / sizeof(float) % VEC);
  return lo - (lo + misaligned) % VEC;
}

// Exclusive prefix sums over the block of two packed counters, and their block totals.
__device__ ulonglong2 block_exclusive_sum(ulonglong2 v, ulonglong2& total, Scratch& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  ulonglong2 inc = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    unsigned long long x = __shfl_up_sync(0xffffffffu, inc.x, d);
    unsigned long long y = __shfl_up_sync(0xffffffffu, inc.y, d);
    if (lane >= d) { inc.x += x; inc.y += y; }
  }
  if (lane == 31) s.warp_sums[warp] = inc;
  __syncthreads();
  ulonglong2 before = make_ulonglong2(0, 0);
  total = make_ulonglong2(0, 0);
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const ulonglong2 t = s.warp_sums[w];
    if (w < warp) { before.x += t.x; before.y += t.y; }
    total.x += t.x; total.y += t.y;
  }
  __syncthreads();  // warp_sums is reused by the next call
  return make_ulonglong2(before.x + inc.x - v.x, before.y + inc.y - v.y);
}

// The bin among [0, bins) holding the need-th largest entry, where count(b) is bin b's entries
// (need is capped at all the entries; digit -1 when there are none). Every thread gets the result.
template <class Count>
__device__ Digit pick_digit(int bins, int need, Scratch& s, Count count) {
  constexpr int PER = BINS / THREADS;  // thread t owns bins bins-1-PER*t-i, i < PER (descending)
  uint32_t h[PER];
  uint32_t local = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int b = bins - 1 - PER * static_cast<int>(threadIdx.x) - i;
    h[i] = b >= 0 ? count(b) : 0;
    local += h[i];
  }
  ulonglong2 total;
  const unsigned long long before = block_exclusive_sum(make_ulonglong2(local, 0), total, s).x;
  need = min(need, static_cast<int>(total.x));
  if (threadIdx.x == 0) s.pick = Digit{-1, 0, 0, need};
  __syncthreads();
  unsigned long long at_or_above = before;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    at_or_above += h[i];
    if (need > 0 && h[i] > 0 && at_or_above >= static_cast<unsigned>(need) &&
        at_or_above - h[i] < static_cast<unsigned>(need)) {
      s.pick = Digit{bins - 1 - PER * static_cast<int>(threadIdx.x) - i, static_cast<int>(at_or_above - h[i]),
                     static_cast<int>(h[i]), need};
    }
  }
  __syncthreads();
  return s.pick;  // rewritten only after the next call's first barrier, which every reader passes after this
}

// out[0, topk): the n <= MAX_TOPK entries entry(r) = (key, column), r < n, given in column order,
// by descending key (a stable sort: equal keys keep column order, so the lower column comes
// first), then -1. `storage` may overlay whatever entry() reads: they are in registers first.
template <class Entry>
__device__ void write_sorted(int n, int topk, int* out, typename Sort::TempStorage& storage, Entry entry) {
  uint32_t key[SORT_ITEMS];
  int pos[SORT_ITEMS];
#pragma unroll
  for (int i = 0; i < SORT_ITEMS; ++i) {
    const int r = SORT_ITEMS * threadIdx.x + i;
    key[i] = 0u;  // no finite score's key, so padding sorts last
    pos[i] = -1;
    if (r < n) entry(r, key[i], pos[i]);
  }
  __syncthreads();
  Sort(storage).SortDescending(key, pos);
#pragma unroll
  for (int i = 0; i < SORT_ITEMS; ++i) {
    const int r = SORT_ITEMS * threadIdx.x + i;
    if (r < topk) out[r] = r < n ? pos[i] : -1;
  }
}

}  // namespace

// topk_cluster.cu: the CTAs per row for `rows` rows of `width` columns on a GPU of `sms` SMs (the
// fewest whose slices fit shared memory, more while the rows fill fewer than two CTAs per SM), or
// 0 when a row does not fit in MAX_CLUSTER CTAs; and its launch.
int cluster_topk_ranks(int64_t rows, int64_t width, int sms);
cudaError_t launch_cluster_topk(int ranks, const float* logits, int64_t stride, int64_t rows, int64_t width,
                                const int* starts, const int* ends, int64_t topk, bool sorted, int* out,
                                int64_t out_stride, cudaStream_t stream);

}  // namespace flashdsa
