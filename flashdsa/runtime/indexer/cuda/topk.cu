// Indexer top-k for Hopper: one CTA per row, a radix select on the scores' order-preserving
// 32-bit keys, then a sort (or a merge by position) of the selection in shared memory.
//
// Contract (flashdsa.runtime.indexer.indexer_topk): out[row] holds the columns of the topk
// largest finite scores of logits[row, start:end), by descending score with ties to the lower
// column (sorted) or by ascending column (unsorted), then -1.
//
// Per row:
//  1. histogram the top 11 key bits of the usable scores (in range and finite) in shared memory;
//     the bin holding the k-th largest is the threshold prefix, the bins above it are taken whole;
//  2. while the threshold bin holds more than CAND_CAP scores, re-read the row and histogram the
//     next digit (11, then 10 bits) of the scores in it (never on spread-out scores);
//  3. one ordered pass (a block scan per tile keeps column order) appends the columns above the
//     threshold prefix to the selected list and those level with it to the candidate list (at
//     full key depth, the first `need` of them: the lower columns win ties);
//  4. the candidates' remaining digits are resolved in shared memory and they are compacted in
//     order: above the exact threshold key, or level with it and among the first `need`;
//  5. sorted: a stable radix sort by key, descending (equal keys sit in column order, so the lower
//     column comes first); unsorted: the two column-ordered lists are merged.
// Scores stream through 128-bit loads (each row's tiles start at a 16-byte aligned column).

#include <cstdint>
#include <cuda_runtime.h>
#include <cub/block/block_radix_sort.cuh>

namespace flashdsa {
namespace {

constexpr int THREADS = 512;
constexpr int VEC = 4;                   // scores per 128-bit load
constexpr int LOADS = 2;                 // 128-bit loads per thread and tile (4 spill at 64 registers)
constexpr int MAX_TOPK = 2048;           // the selection is held and sorted in shared memory
constexpr int CAND_CAP = 4096;           // threshold-bin scores resolved in shared memory
constexpr int BINS = 2048;               // 11-bit digits
constexpr int LEVELS = 3;
// key digits, most significant first: bits [21, 32), [10, 21), [0, 10)
__host__ __device__ constexpr int shift_of(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
__host__ __device__ constexpr int bits_of(int level) { return level == 2 ? 10 : 11; }
constexpr int SORT_ITEMS = MAX_TOPK / THREADS;
constexpr int CAND_ITEMS = CAND_CAP / THREADS;
constexpr int WARPS = THREADS / 32;

using Sort = cub::BlockRadixSort<uint32_t, THREADS, SORT_ITEMS, int>;

struct Shared {
  union {
    struct {
      uint32_t hist[BINS];
      uint32_t cand_key[CAND_CAP];
      int cand_pos[CAND_CAP];
    } select;
    typename Sort::TempStorage sort;
  };
  uint32_t sel_key[MAX_TOPK];
  int sel_pos[MAX_TOPK];
  ulonglong2 warp_sums[WARPS];
  int digit, above, level_count, need;  // the last pick_digit
};

static_assert(sizeof(Shared) <= 113 * 1024, "two CTAs per SM need at most 113 KB of shared memory each");

// fp32 -> uint32 whose unsigned order is the float order; -0.0 maps with +0.0 (a tie).
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ bool is_finite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// Exclusive prefix sums over the block of two packed counters, and their block totals.
__device__ ulonglong2 block_exclusive_sum(ulonglong2 v, ulonglong2& total, Shared& s) {
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

// The bin of s.hist[0, bins) holding the need-th largest entry (need capped at the entries):
// s.digit, s.above (entries in higher bins), s.level_count (entries in it), s.need (capped).
__device__ void pick_digit(int bins, int need, Shared& s) {
  constexpr int PER = BINS / THREADS;  // thread t owns bins BINS-1-PER*t-i, i < PER (descending)
  uint32_t h[PER];
  uint32_t local = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int b = BINS - 1 - PER * threadIdx.x - i - (BINS - bins);
    h[i] = b >= 0 ? s.select.hist[b] : 0;
    local += h[i];
  }
  ulonglong2 total;
  const unsigned long long before = block_exclusive_sum(make_ulonglong2(local, 0), total, s).x;
  need = min(need, static_cast<int>(total.x));
  if (threadIdx.x == 0) { s.need = need; s.digit = -1; }
  __syncthreads();
  unsigned long long at_or_above = before;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    at_or_above += h[i];
    if (need > 0 && h[i] > 0 && at_or_above >= static_cast<unsigned>(need) &&
        at_or_above - h[i] < static_cast<unsigned>(need)) {
      s.digit = BINS - 1 - PER * threadIdx.x - i - (BINS - bins);
      s.above = static_cast<int>(at_or_above - h[i]);
      s.level_count = static_cast<int>(h[i]);
    }
  }
  __syncthreads();
}

// One tile of a row's scores: element (j, i) of thread t sits at column
// base + (j * THREADS + t) * VEC + i, so (j, t, i) is column order. A score outside [lo, hi) or not
// finite gets key 0, which no finite score has (the lowest, -FLT_MAX's, is 0x00800000). Tiles start
// where the row's address is 16-byte aligned (first_tile), so inside the row every load is 128-bit.
struct Tile {
  static constexpr int SIZE = THREADS * VEC * LOADS;
  uint32_t key[LOADS][VEC];

  __device__ __forceinline__ static int pos(int base, int j, int i) { return base + (j * THREADS + threadIdx.x) * VEC + i; }

  __device__ __forceinline__ void load(const float* row, int base, int lo, int hi, int width) {
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int p = pos(base, j, 0);
      float v[VEC];
      if (p >= 0 && p + VEC <= width && p < hi) {
        const float4 q = *reinterpret_cast<const float4*>(row + p);
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = (p + i < hi && p + i >= lo) ? row[p + i] : __int_as_float(0x7f800000);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        key[j][i] = p + i >= lo && p + i < hi && is_finite(v[i]) ? order_key(v[i]) : 0u;
      }
    }
  }

  // The first tile's column: at or below lo, where the row's address is 16-byte aligned (fp32
  // rows are 4-byte aligned, so some column among lo - 3 .. lo is).
  __device__ __forceinline__ static int first_tile(const float* row, int lo) {
    const int misaligned = static_cast<int>(reinterpret_cast<uintptr_t>(row) / sizeof(float) % VEC);
    return lo - (lo + misaligned) % VEC;
  }
};

// Histogram of digit `level` of the usable keys whose bits above it equal `prefix`.
__device__ void histogram_row(const float* row, int lo, int hi, int width, int level, uint32_t prefix, Shared& s) {
  for (int b = threadIdx.x; b < BINS; b += THREADS) s.select.hist[b] = 0;
  __syncthreads();
  const int shift = shift_of(level), mask = (1 << bits_of(level)) - 1;
  const int above_shift = level == 0 ? 32 : shift_of(level - 1);
  Tile tile;
#pragma unroll 2
  for (int base = Tile::first_tile(row, lo); base < hi; base += Tile::SIZE) {
    tile.load(row, base, lo, hi, width);
#pragma unroll
    for (int j = 0; j < LOADS; ++j)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const uint32_t k = tile.key[j][i];
        const bool match = above_shift == 32 || (k >> above_shift) == prefix;
        if (k != 0 && match) atomicAdd(&s.select.hist[(k >> shift) & mask], 1u);
      }
  }
  __syncthreads();
}

// Ordered pass: columns whose key >> shift is above `prefix` are appended to the selected list,
// those equal to it to the candidate list (only the first `keep_equal` of them when exact).
__device__ void collect_row(const float* row, int lo, int hi, int width, int shift, uint32_t prefix, bool exact,
                            int keep_equal, int& num_sel, int& num_cand, Shared& s) {
  num_sel = 0;
  num_cand = 0;
  Tile tile;
  for (int base = Tile::first_tile(row, lo); base < hi; base += Tile::SIZE) {
    tile.load(row, base, lo, hi, width);
    unsigned long long packed_above = 0, packed_equal = 0;  // 16-bit count per load j
#pragma unroll
    for (int j = 0; j < LOADS; ++j)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const uint32_t high = tile.key[j][i] >> shift;
        const bool ok = tile.key[j][i] != 0;
        packed_above += static_cast<unsigned long long>(ok && high > prefix) << (16 * j);
        packed_equal += static_cast<unsigned long long>(ok && high == prefix) << (16 * j);
      }
    ulonglong2 total;
    const ulonglong2 before = block_exclusive_sum(make_ulonglong2(packed_above, packed_equal), total, s);
    int sel_at = num_sel, cand_at = num_cand;
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      int a = sel_at + static_cast<int>((before.x >> (16 * j)) & 0xffff);
      int e = cand_at + static_cast<int>((before.y >> (16 * j)) & 0xffff);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const uint32_t k = tile.key[j][i];
        const uint32_t high = k >> shift;
        const int p = Tile::pos(base, j, i);
        if (k != 0 && high > prefix) {
          s.sel_key[a] = k;
          s.sel_pos[a++] = p;
        } else if (k != 0 && high == prefix) {
          if (!exact || e < keep_equal) {
            s.select.cand_key[e] = k;
            s.select.cand_pos[e] = p;
          }
          ++e;
        }
      }
      sel_at += static_cast<int>((total.x >> (16 * j)) & 0xffff);
      cand_at += static_cast<int>((total.y >> (16 * j)) & 0xffff);
    }
    num_sel = sel_at;
    num_cand = cand_at;
  }
  if (exact) num_cand = min(num_cand, keep_equal);
  __syncthreads();
}

// Resolves digits `level`.. of the candidates (all level with `prefix` above digit `level`), then
// keeps, in order, those above the exact threshold key and the first `need` level with it.
// Returns how many are kept.
__device__ int refine_candidates(int num_cand, int level, uint32_t prefix, int need, Shared& s) {
  for (; level < LEVELS; ++level) {
    for (int b = threadIdx.x; b < BINS; b += THREADS) s.select.hist[b] = 0;
    __syncthreads();
    const int shift = shift_of(level), mask = (1 << bits_of(level)) - 1, above_shift = shift_of(level - 1);
    for (int c = threadIdx.x; c < num_cand; c += THREADS) {
      const uint32_t k = s.select.cand_key[c];
      if ((k >> above_shift) == prefix) atomicAdd(&s.select.hist[(k >> shift) & mask], 1u);
    }
    __syncthreads();
    pick_digit(1 << bits_of(level), need, s);
    prefix = (prefix << bits_of(level)) | static_cast<uint32_t>(s.digit);
    need -= s.above;
  }
  // prefix is the exact threshold key; thread t owns candidates [CAND_ITEMS * t, CAND_ITEMS * (t + 1))
  uint32_t key[CAND_ITEMS];
  int pos[CAND_ITEMS];
  unsigned long long equal = 0;
#pragma unroll
  for (int i = 0; i < CAND_ITEMS; ++i) {
    const int c = CAND_ITEMS * threadIdx.x + i;
    key[i] = c < num_cand ? s.select.cand_key[c] : 0;
    pos[i] = c < num_cand ? s.select.cand_pos[c] : 0;
    equal += c < num_cand && key[i] == prefix;
  }
  ulonglong2 total;
  int equal_rank = static_cast<int>(block_exclusive_sum(make_ulonglong2(equal, 0), total, s).x);
  bool keep[CAND_ITEMS];
  unsigned long long kept = 0;
#pragma unroll
  for (int i = 0; i < CAND_ITEMS; ++i) {
    const int c = CAND_ITEMS * threadIdx.x + i;
    const bool level_with = c < num_cand && key[i] == prefix;
    keep[i] = c < num_cand && (key[i] > prefix || (level_with && equal_rank < need));
    equal_rank += level_with;
    kept += keep[i];
  }
  int at = static_cast<int>(block_exclusive_sum(make_ulonglong2(kept, 0), total, s).x);
#pragma unroll
  for (int i = 0; i < CAND_ITEMS; ++i)
    if (keep[i]) {
      s.select.cand_key[at] = key[i];
      s.select.cand_pos[at++] = pos[i];
    }
  __syncthreads();
  return static_cast<int>(total.x);
}

// Number of entries of the ascending list[0, n) below value.
__device__ __forceinline__ int count_below(const int* list, int n, int value) {
  int lo = 0;
  while (n > 0) {
    const int half = n >> 1;
    if (list[lo + half] < value) { lo += half + 1; n -= half + 1; } else { n = half; }
  }
  return lo;
}

__device__ void write_sorted(int num_sel, int num_cand, int topk, int* out, Shared& s) {
  uint32_t key[SORT_ITEMS];
  int pos[SORT_ITEMS];
#pragma unroll
  for (int i = 0; i < SORT_ITEMS; ++i) {
    const int r = SORT_ITEMS * threadIdx.x + i;  // selected first, then kept candidates: equal keys stay in column order
    key[i] = r < num_sel ? s.sel_key[r] : r < num_sel + num_cand ? s.select.cand_key[r - num_sel] : 0u;
    pos[i] = r < num_sel ? s.sel_pos[r] : r < num_sel + num_cand ? s.select.cand_pos[r - num_sel] : -1;
  }
  __syncthreads();  // the sort's storage overlays the candidates
  Sort(s.sort).SortDescending(key, pos);  // stable; key 0 is no finite score's key, so padding sorts last
#pragma unroll
  for (int i = 0; i < SORT_ITEMS; ++i) {
    const int r = SORT_ITEMS * threadIdx.x + i;
    if (r < topk) out[r] = r < num_sel + num_cand ? pos[i] : -1;
  }
}

__device__ void write_by_position(int num_sel, int num_cand, int topk, int* out, Shared& s) {
  for (int i = threadIdx.x; i < num_sel; i += THREADS)
    out[i + count_below(s.select.cand_pos, num_cand, s.sel_pos[i])] = s.sel_pos[i];
  for (int i = threadIdx.x; i < num_cand; i += THREADS)
    out[i + count_below(s.sel_pos, num_sel, s.select.cand_pos[i])] = s.select.cand_pos[i];
  for (int r = num_sel + num_cand + threadIdx.x; r < topk; r += THREADS) out[r] = -1;
}

__global__ void __launch_bounds__(THREADS, 2)
topk_kernel(const float* __restrict__ logits, int64_t stride, int width, const int* __restrict__ starts,
            const int* __restrict__ ends, int topk, bool sorted, int* __restrict__ out, int64_t out_stride) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared& s = *reinterpret_cast<Shared*>(smem);
  const int64_t row = blockIdx.x;
  const float* row_ptr = logits + row * stride;
  const int hi = min(max(ends[row], 0), width), lo = min(max(starts[row], 0), hi);  // never outside the row
  out += row * out_stride;

  histogram_row(row_ptr, lo, hi, width, 0, 0, s);
  pick_digit(BINS, topk, s);
  const int need = s.need;
  if (need == 0) {
    for (int r = threadIdx.x; r < topk; r += THREADS) out[r] = -1;
    return;
  }
  uint32_t prefix = static_cast<uint32_t>(s.digit);
  int left = need - s.above, count = s.level_count, level = 0;
  while (count > CAND_CAP && level + 1 < LEVELS) {  // a crowded threshold bin: one more digit from the row
    ++level;
    histogram_row(row_ptr, lo, hi, width, level, prefix, s);
    pick_digit(1 << bits_of(level), left, s);
    prefix = (prefix << bits_of(level)) | static_cast<uint32_t>(s.digit);
    left -= s.above;
    count = s.level_count;
  }
  const bool exact = level + 1 == LEVELS;
  int num_sel, num_cand;
  collect_row(row_ptr, lo, hi, width, shift_of(level), prefix, exact, left, num_sel, num_cand, s);
  if (!exact) num_cand = refine_candidates(num_cand, level + 1, prefix, left, s);
  if (sorted) {
    write_sorted(num_sel, num_cand, topk, out, s);
  } else {
    write_by_position(num_sel, num_cand, topk, out, s);
  }
}

}  // namespace

int indexer_topk_max_topk() { return MAX_TOPK; }

// Launches the top-k of `rows` rows of `width` fp32 scores (row r at logits + r * stride) into
// out [rows, topk] int32 (row stride out_stride) on `stream` of `device`. Returns nullptr or the
// CUDA error's text.
const char* launch_indexer_topk(const float* logits, int64_t stride, int64_t rows, int64_t width, const int* starts,
                                const int* ends, int64_t topk, bool sorted, int* out, int64_t out_stride, int device,
                                void* stream) {
  if (rows == 0) return nullptr;
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const int bytes = sizeof(Shared);
  err = cudaFuncSetAttribute(topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) {
    topk_kernel<<<static_cast<unsigned>(rows), THREADS, bytes, static_cast<cudaStream_t>(stream)>>>(
        logits, stride, static_cast<int>(width), starts, ends, static_cast<int>(topk), sorted, out, out_stride);
    err = cudaGetLastError();
  }
  if (previous != device) cudaSetDevice(previous);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace flashdsa
