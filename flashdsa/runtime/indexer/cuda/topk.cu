// Indexer top-k for Hopper: one CTA per row, a radix select on the scores' order-preserving
// 32-bit keys, then a sort of the selection in shared memory.
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
//  3. one more pass over the row appends the columns above the threshold prefix to the selected
//     list and those level with it to the candidate list, in any order (one shared-memory atomic
//     per warp and list, no block barrier, so the loads of successive tiles overlap);
//  4. the candidates' remaining digits are resolved in shared memory down to the exact threshold
//     key; of the candidates level with it, the lowest columns are kept (a radix select on the
//     columns when there are more than needed);
//  5. unsorted, the selection's columns set bits of a bitmap of the row in shared memory, read back in
//     order (a block scan of each thread's count; a row wider than the bitmap is radix sorted by
//     column); sorted, the selection is radix sorted by key descending relative to
//     its lowest (key - lowest + 1: about 24 bits for scores within a factor of two of each
//     other, against 32 + column bits for (key, column) packed), the columns along, then each
//     run of equal keys is put in column order in shared memory (an entry's place: the run's
//     start plus the run's entries of lower column); a row with a run longer than TIE_RUN_MAX
//     sorts (key, inverted column) packed in 64 bits instead.
// A row of 16 tiles or more first tries one pass instead of 1-3: a sample (every 8th tile) is
// histogrammed to two digits (21 key bits), which set a floor about 5/4 * topk scores down the row
// (a coarse first digit alone would often leave more than CAND_CAP scores in the threshold bin);
// one pass appends the columns at or above the floor to the candidate list, and when it holds at
// least topk and at most CAND_CAP of them, step 4 picks the exact top-k among them. Otherwise
// (an unrepresentative sample) the row takes steps 1-4.
// A batch of long rows too small to give every pair of CTAs an SM runs a cluster of two CTAs a row
// (run_pair): each samples, histograms and collects one half of the row, the pair sums its
// histograms through distributed shared memory so both pick the same floor, and CTA 0 appends
// CTA 1's candidates to its own and selects.
// Only a row whose exact threshold key is held by more than CAND_CAP scores (a crowded tie) takes
// an ordered pass instead of 3-4: a block scan per tile keeps column order, so the first columns
// of the tie are taken. Scores stream through 128-bit loads (each row's tiles start at a 16-byte
// aligned column).
//
// Short rows (decode-sized: DeepSeek-V4's CSA indexer sees 1024 entries at a 4K context) spend
// most of that pipeline on block barriers, so rows of at most RANK_MAX_WIDTH columns, while the
// batch's rows x width^2 comparisons stay under RANK_MAX_WORK, take rank_kernel instead: every
// usable score's rank (how many usable scores beat it: higher, or level with a lower column) is
// counted against the whole row held in shared memory, by RANK_SPLIT lanes a column and many CTAs
// a row, and the column is written at out[rank] when the rank is below topk. That is the sorted
// order, which it returns for unsorted calls too.

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cuda_runtime.h>
#include <cooperative_groups.h>
#include <cub/block/block_radix_sort.cuh>

#include "shared_memory_opt_in.cuh"

namespace flashdsa {
namespace {

constexpr int VEC = 4;                   // scores per 128-bit load
constexpr int LOADS = 2;                 // 128-bit loads per thread and tile (4 spill at 64 registers)
constexpr int MAX_TOPK = 2048;           // the selection is held and sorted in shared memory
constexpr int CAND_CAP = 4096;           // threshold-bin scores resolved in shared memory
constexpr int BINS = 2048;               // 11-bit digits
constexpr int LEVELS = 3;
constexpr int SAMPLE_STRIDE = 8;         // one-pass rows: every 8th tile samples the scores for the floor
// Sorted output: each entry of a run of equal keys counts the run's entries of lower column, so
// 2048 entries in runs of 64 read 128K columns (4K warp-wide loads, about one radix pass); a row
// with a longer run sorts again by (key, column) packed in 64 bits (13 passes at 128K columns).
constexpr int TIE_RUN_MAX = 64;
// key digits, most significant first: bits [21, 32), [10, 21), [0, 10)
__host__ __device__ constexpr int shift_of(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
__host__ __device__ constexpr int bits_of(int level) { return level == 2 ? 10 : 11; }

// Which tiles of a row a pass reads: all, or the sample (tiles 0, SAMPLE_STRIDE, 2 * SAMPLE_STRIDE,
// ... from the row's first tile).
enum class Tiles { kAll, kSample };

// fp32 -> uint32 whose unsigned order is the float order; -0.0 maps with +0.0 (a tie).
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float whose key is `key` (order_key's inverse; key 0x80000000 is +0.0).
__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ bool is_finite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// The kernel's pieces for CTAs of THREADS threads (512: two CTAs an SM, for many rows; 1024: one,
// for rows too few to fill the GPU with two CTAs an SM).
template <int THREADS>
struct TopK {
  static constexpr int SORT_ITEMS = MAX_TOPK / THREADS;
  static constexpr int CAND_ITEMS = CAND_CAP / THREADS;
  static constexpr int WARPS = THREADS / 32;
  // digit bits of the relative-key sort's passes (5 fits 113 KB at 512 threads only, and spills there)
  static constexpr int REL_RADIX_BITS = 4;

  using SortByRel = cub::BlockRadixSort<uint32_t, THREADS, SORT_ITEMS, int, REL_RADIX_BITS>;  // key - lowest + 1
  using SortByScore = cub::BlockRadixSort<uint64_t, THREADS, SORT_ITEMS>;  // (key, ~column) packed: long ties
  using SortByColumn = cub::BlockRadixSort<uint32_t, THREADS, SORT_ITEMS>;

  struct Shared {
    union {
      struct {
        uint32_t hist[BINS];
        uint32_t cand_key[CAND_CAP];
        int cand_pos[CAND_CAP];
        uint32_t tie_key[CAND_CAP];  // the inverted columns of the candidates level with the threshold
      } select;
      uint32_t column_set[BINS + 3 * CAND_CAP];  // unsorted output: a bit per column of the row, set if selected
      typename SortByRel::TempStorage by_rel;
      typename SortByScore::TempStorage by_score;
      typename SortByColumn::TempStorage by_column;
    };
    uint32_t sel_key[MAX_TOPK];  // after the relative-key sort: its keys and columns, by rank
    int sel_pos[MAX_TOPK];
    ulonglong2 warp_sums[WARPS];
    int digit, above, level_count, need;  // the last pick_digit
    int num_sel, num_cand, num_ties;  // list lengths appended to by atomics
    uint32_t key_min, key_max;  // the selection's lowest and highest keys
  };

  static_assert(sizeof(Shared) <= 113 * 1024, "two CTAs per SM need at most 113 KB of shared memory each");

  // Exclusive prefix sums over the block of two packed counters, and their block totals.
  static __device__ ulonglong2 block_exclusive_sum(ulonglong2 v, ulonglong2& total, Shared& s) {
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
    // every warp scans the warp sums in its lanes (lane w holds warp w's), so warp `warp` finds
    // the sum of the warps before it in lane warp - 1 and the total in the last lane
    ulonglong2 sums = lane < WARPS ? s.warp_sums[lane] : make_ulonglong2(0, 0);
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      unsigned long long x = __shfl_up_sync(0xffffffffu, sums.x, d);
      unsigned long long y = __shfl_up_sync(0xffffffffu, sums.y, d);
      if (lane >= d) { sums.x += x; sums.y += y; }
    }
    const int prior = max(warp - 1, 0);
    ulonglong2 before = make_ulonglong2(__shfl_sync(0xffffffffu, sums.x, prior), __shfl_sync(0xffffffffu, sums.y, prior));
    if (warp == 0) before = make_ulonglong2(0, 0);
    total = make_ulonglong2(__shfl_sync(0xffffffffu, sums.x, 31), __shfl_sync(0xffffffffu, sums.y, 31));
    __syncthreads();  // warp_sums is reused by the next call
    return make_ulonglong2(before.x + inc.x - v.x, before.y + inc.y - v.y);
  }

  // The bin of s.hist[0, bins) holding the need-th largest entry (need capped at the entries):
  // s.digit, s.above (entries in higher bins), s.level_count (entries in it), s.need (capped).
  static __device__ void pick_digit(int bins, int need, Shared& s) {
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

    __device__ __forceinline__ static int pos(int base, int j, int i) {
      return base + (j * THREADS + threadIdx.x) * VEC + i;
    }

    // The tile's scores, NaN outside [lo, hi) (not usable, and not at or above any score).
    __device__ __forceinline__ static void load_values(const float* row, int base, int lo, int hi, int width,
                                                       float (&v)[LOADS][VEC]) {
      const bool inside = base >= lo && base + SIZE <= hi;  // the whole tile in range: no column checks
#pragma unroll
      for (int j = 0; j < LOADS; ++j) {
        const int p = pos(base, j, 0);
        if (inside || (p >= 0 && p + VEC <= width && p < hi)) {
          const float4 q = *reinterpret_cast<const float4*>(row + p);
          v[j][0] = q.x; v[j][1] = q.y; v[j][2] = q.z; v[j][3] = q.w;
          if (!inside)
#pragma unroll
            for (int i = 0; i < VEC; ++i) v[j][i] = p + i >= lo && p + i < hi ? v[j][i] : __int_as_float(0x7fffffff);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[j][i] = (p + i < hi && p + i >= lo) ? row[p + i] : __int_as_float(0x7fffffff);
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

  // A row's tiles in order (all, or the sample), each tile's loads issued before the previous tile is
  // used, so two tiles are in flight: the passes over a row wait on memory, not on instructions.
  struct TileStream {
    const float* row;
    int lo, hi, width, step, base;
    float next[LOADS][VEC];

    __device__ __forceinline__ TileStream(const float* row, int lo, int hi, int width, Tiles tiles = Tiles::kAll)
        : row(row), lo(lo), hi(hi), width(width),
          step(tiles == Tiles::kSample ? SAMPLE_STRIDE * Tile::SIZE : Tile::SIZE), base(Tile::first_tile(row, lo)) {
      if (base < hi) Tile::load_values(row, base, lo, hi, width, next);
    }

    __device__ __forceinline__ bool more() const { return base < hi; }

    // The next tile's values (NaN outside [lo, hi)) and its first column; the one after starts loading.
    __device__ __forceinline__ int take(float (&v)[LOADS][VEC]) {
#pragma unroll
      for (int j = 0; j < LOADS; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[j][i] = next[j][i];
      const int taken = base;
      base += step;
      if (base < hi) Tile::load_values(row, base, lo, hi, width, next);
      return taken;
    }

    // As take, as keys: order_key of the usable scores, 0 for the others.
    __device__ __forceinline__ int take_keys(uint32_t (&key)[LOADS][VEC]) {
      float v[LOADS][VEC];
      const int taken = take(v);
#pragma unroll
      for (int j = 0; j < LOADS; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) key[j][i] = is_finite(v[j][i]) ? order_key(v[j][i]) : 0u;
      return taken;
    }
  };

  // Histogram of digit `level` of the usable keys whose bits above it equal `prefix`, over `tiles`.
  static __device__ void histogram_row(const float* row, int lo, int hi, int width, int level, uint32_t prefix,
                                       Shared& s, Tiles tiles = Tiles::kAll) {
    for (int b = threadIdx.x; b < BINS; b += THREADS) s.select.hist[b] = 0;
    __syncthreads();
    const int shift = shift_of(level), mask = (1 << bits_of(level)) - 1;
    const int above_shift = level == 0 ? 32 : shift_of(level - 1);
#pragma unroll 2
    for (TileStream stream(row, lo, hi, width, tiles); stream.more();) {
      uint32_t key[LOADS][VEC];
      stream.take_keys(key);
#pragma unroll
      for (int j = 0; j < LOADS; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const uint32_t k = key[j][i];
          const bool match = above_shift == 32 || (k >> above_shift) == prefix;
          if (k != 0 && match) atomicAdd(&s.select.hist[(k >> shift) & mask], 1u);
        }
    }
    __syncthreads();
  }

  // Appends the row's usable keys at or above `floor` and their columns to the
  // candidate list, in any order, as far as it has room (s.num_cand counts them all: past
  // CAND_CAP, overflowed). One shared-memory atomic per warp and tile holding any.
  // Scores are compared as floats (two instructions a score: most of a long row is below the
  // floor); only those kept are turned into keys.
  static __device__ void collect_from_floor(const float* row, int lo, int hi, int width, uint32_t floor, Shared& s) {
    const float least = key_value(max(floor, order_key(-FLT_MAX)));  // finite: a usable score's key is above
#pragma unroll 2
    for (TileStream stream(row, lo, hi, width); stream.more();) {
      float v[LOADS][VEC];
      const int base = stream.take(v);
      int n = 0;
#pragma unroll
      for (int j = 0; j < LOADS; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) n += v[j][i] >= least && v[j][i] <= FLT_MAX;  // NaN: neither
      if (!__any_sync(0xffffffffu, n)) continue;  // most tiles of a long row
      int at = reserve(n, &s.num_cand);
#pragma unroll
      for (int j = 0; j < LOADS; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (v[j][i] >= least && v[j][i] <= FLT_MAX) {
            if (at < CAND_CAP) {
              s.select.cand_key[at] = order_key(v[j][i]);
              s.select.cand_pos[at] = Tile::pos(base, j, i);
            }
            ++at;
          }
    }
    __syncthreads();
  }

  static __device__ void clear_lists(Shared& s) {
    if (threadIdx.x == 0) s.num_sel = s.num_cand = 0;
    __syncthreads();
  }

  // Reserves room for `count` entries of this thread in a shared list: one atomic per warp on
  // `length`, the lanes' slots in lane order. Every lane of the warp calls it.
  static __device__ __forceinline__ int reserve(int count, int* length) {
    const int lane = threadIdx.x & 31;
    int inclusive = count;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += x;
    }
    int base = 0;
    if (lane == 31 && inclusive > 0) base = atomicAdd(length, inclusive);
    return __shfl_sync(0xffffffffu, base, 31) + inclusive - count;
  }

  // Unordered pass over the row: columns whose key >> shift is above `prefix` are appended to the
  // selected list, those equal to it to the candidate list (s.num_sel, s.num_cand long after the
  // call; clear_lists before the first appends).
  static __device__ void gather_row(const float* row, int lo, int hi, int width, int shift, uint32_t prefix,
                                    Shared& s) {
#pragma unroll 2
    for (TileStream stream(row, lo, hi, width); stream.more();) {
      uint32_t key[LOADS][VEC];
      const int base = stream.take_keys(key);
      int above = 0, equal = 0;
#pragma unroll
      for (int j = 0; j < LOADS; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const uint32_t high = key[j][i] >> shift;
          above += key[j][i] != 0 && high > prefix;
          equal += key[j][i] != 0 && high == prefix;
        }
      if (!__any_sync(0xffffffffu, above + equal)) continue;  // most tiles of a long row
      int a = reserve(above, &s.num_sel), e = reserve(equal, &s.num_cand);
#pragma unroll
      for (int j = 0; j < LOADS; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const uint32_t k = key[j][i];
          if (k == 0) continue;
          if ((k >> shift) > prefix) {
            s.sel_key[a] = k;
            s.sel_pos[a++] = Tile::pos(base, j, i);
          } else if ((k >> shift) == prefix) {
            s.select.cand_key[e] = k;
            s.select.cand_pos[e++] = Tile::pos(base, j, i);
          }
        }
    }
    __syncthreads();
  }

  // Ordered pass at full key depth: columns whose key is above `threshold` are appended to the
  // selected list and the first `keep_equal` level with it to the candidate list, in column order.
  static __device__ void collect_row_in_order(const float* row, int lo, int hi, int width, uint32_t threshold,
                                              int keep_equal, int& num_sel, int& num_cand, Shared& s) {
    num_sel = 0;
    num_cand = 0;
    for (TileStream stream(row, lo, hi, width); stream.more();) {
      uint32_t key[LOADS][VEC];
      const int base = stream.take_keys(key);
      unsigned long long packed_above = 0, packed_equal = 0;  // 16-bit count per load j
#pragma unroll
      for (int j = 0; j < LOADS; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const uint32_t k = key[j][i];
          packed_above += static_cast<unsigned long long>(k != 0 && k > threshold) << (16 * j);
          packed_equal += static_cast<unsigned long long>(k != 0 && k == threshold) << (16 * j);
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
          const uint32_t k = key[j][i];
          const int p = Tile::pos(base, j, i);
          if (k != 0 && k > threshold) {
            s.sel_key[a] = k;
            s.sel_pos[a++] = p;
          } else if (k != 0 && k == threshold) {
            if (e < keep_equal) {
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
    num_cand = min(num_cand, keep_equal);
    __syncthreads();
  }

  // The exact key of the need-th largest of keys[0, n), resolving digits `level`.. of those whose
  // digits above `level` equal `prefix` (all of them at level 0); `need` becomes how many entries
  // level with that key are taken.
  static __device__ uint32_t exact_threshold(const uint32_t* keys, int n, int level, uint32_t prefix, int& need,
                                             Shared& s) {
    for (; level < LEVELS; ++level) {
      for (int b = threadIdx.x; b < BINS; b += THREADS) s.select.hist[b] = 0;
      __syncthreads();
      const int shift = shift_of(level), mask = (1 << bits_of(level)) - 1;
      for (int c = threadIdx.x; c < n; c += THREADS) {
        const uint32_t k = keys[c];
        if (level == 0 || (k >> shift_of(level - 1)) == prefix) atomicAdd(&s.select.hist[(k >> shift) & mask], 1u);
      }
      __syncthreads();
      pick_digit(1 << bits_of(level), need, s);
      prefix = (prefix << bits_of(level)) | static_cast<uint32_t>(s.digit);
      need -= s.above;
    }
    return prefix;
  }

  // Keeps, of the candidates (level with `prefix` above digit `level`), the `need` largest, ties to
  // the lower column, compacted to the front of the candidate list in any order. Returns `need`.
  static __device__ int keep_candidates(int num_cand, int level, uint32_t prefix, int need, Shared& s) {
    const int kept_total = need;
    const uint32_t threshold = exact_threshold(s.select.cand_key, num_cand, level, prefix, need, s);
    // every thread has read s.num_cand (the caller's argument) before it is reset: exact_threshold
    // makes no barrier when the row's digit passes resolved every level
    __syncthreads();
    if (threadIdx.x == 0) s.num_ties = s.num_cand = 0;
    __syncthreads();
    uint32_t key[CAND_ITEMS];
    int pos[CAND_ITEMS];
    int ties = 0;
#pragma unroll
    for (int i = 0; i < CAND_ITEMS; ++i) {
      const int c = THREADS * i + threadIdx.x;
      key[i] = c < num_cand ? s.select.cand_key[c] : 0;
      pos[i] = c < num_cand ? s.select.cand_pos[c] : 0;
      ties += key[i] == threshold;  // key 0 never: a candidate is finite
    }
    const int tie_at = reserve(ties, &s.num_ties);
    __syncthreads();
    uint32_t lowest_kept = 0;  // ties are kept while their inverted column is at least this
    if (s.num_ties > need) {   // more ties than room: the lowest columns, by a select on ~column
      for (int i = 0, t = tie_at; i < CAND_ITEMS; ++i)
        if (key[i] == threshold) s.select.tie_key[t++] = ~static_cast<uint32_t>(pos[i]);
      __syncthreads();
      int exact_need = need;
      lowest_kept = exact_threshold(s.select.tie_key, s.num_ties, 0, 0, exact_need, s);
    }
    int kept = 0;
#pragma unroll
    for (int i = 0; i < CAND_ITEMS; ++i)
      kept += key[i] > threshold || (key[i] == threshold && ~static_cast<uint32_t>(pos[i]) >= lowest_kept);
    int at = reserve(kept, &s.num_cand);  // the candidates are in registers: overwriting the list is safe
#pragma unroll
    for (int i = 0; i < CAND_ITEMS; ++i)
      if (key[i] > threshold || (key[i] == threshold && ~static_cast<uint32_t>(pos[i]) >= lowest_kept)) {
        s.select.cand_key[at] = key[i];
        s.select.cand_pos[at++] = pos[i];
      }
    __syncthreads();
    return kept_total;
  }

  // Sorts the selected list and the kept candidates together into out[0, topk), -1 padded.
  static __device__ void write_selection(int num_sel, int num_cand, int topk, int width, bool sorted, int* out,
                                         Shared& s) {
    const int n = num_sel + num_cand;
    const int column_bits = 32 - __clz(max(width - 1, 1));  // every column fits
    const uint32_t last_column = static_cast<uint32_t>((uint64_t{1} << column_bits) - 1);
    if (threadIdx.x == 0) { s.key_min = ~0u; s.key_max = 0; }
    uint32_t key[SORT_ITEMS], pos[SORT_ITEMS];
    uint32_t key_min = ~0u, key_max = 0;
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
      const int r = SORT_ITEMS * threadIdx.x + i;
      key[i] = r < num_sel ? s.sel_key[r] : r < n ? s.select.cand_key[r - num_sel] : 0u;
      pos[i] = r < num_sel ? s.sel_pos[r] : r < n ? s.select.cand_pos[r - num_sel] : last_column;
      if (r < n) { key_min = min(key_min, key[i]); key_max = max(key_max, key[i]); }
    }
    __syncthreads();  // the sorts' storage overlays the candidates; s.key_min, s.key_max are set
    if (sorted) {
      write_by_score(key, pos, key_min, key_max, n, topk, column_bits, last_column, out, s);
      return;
    }
    if (width <= 32 * static_cast<int>(sizeof(s.column_set) / sizeof(uint32_t))) {
      write_in_column_order(pos, n, topk, width, out, s);
      return;
    }
    SortByColumn(s.by_column).Sort(pos, 0, column_bits);  // padding (every bit set) last
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
      const int r = SORT_ITEMS * threadIdx.x + i;
      if (r < topk) out[r] = r < n ? static_cast<int>(pos[i]) : -1;
    }
  }

  // write_selection's column order without a sort, for rows whose columns fit s.column_set: each
  // entry sets its column's bit; each thread owns a run of words, counts their bits, and writes
  // their columns from its place (a block scan of the counts).
  static __device__ void write_in_column_order(const uint32_t (&pos)[SORT_ITEMS], int n, int topk, int width,
                                               int* out, Shared& s) {
    const int words = (width + 31) / 32, per = (words + THREADS - 1) / THREADS;
    for (int w = threadIdx.x; w < words; w += THREADS) s.column_set[w] = 0;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i)
      if (SORT_ITEMS * threadIdx.x + i < n) atomicOr(&s.column_set[pos[i] / 32], 1u << (pos[i] % 32));
    __syncthreads();
    const int first = threadIdx.x * per, last = min(first + per, words);
    int count = 0;
    for (int w = first; w < last; ++w) count += __popc(s.column_set[w]);
    ulonglong2 total;
    int at = static_cast<int>(block_exclusive_sum(make_ulonglong2(count, 0), total, s).x);
    for (int w = first; w < last; ++w)
      for (uint32_t bits = s.column_set[w]; bits != 0; bits &= bits - 1) out[at++] = 32 * w + __ffs(bits) - 1;
    for (int r = n + threadIdx.x; r < topk; r += THREADS) out[r] = -1;
  }

  // write_by_score's fallback for rows with a run of equal keys longer than TIE_RUN_MAX: the
  // relative keys and columns it left in sel_key / sel_pos, sorted by (key, inverted column)
  // packed in 64 bits. Not inlined: inside write_by_score its registers spilled.
  static __device__ __noinline__ void write_packed(int n, int topk, uint32_t lowest, int column_bits,
                                                   uint32_t last_column, int* out, Shared& s) {
    uint64_t item[SORT_ITEMS];
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
      // key, then the inverted column (the lower column first); padding 0, last
      const int r = THREADS * i + threadIdx.x;
      const uint32_t key = s.sel_key[r];
      item[i] = key != 0 ? (static_cast<uint64_t>(key - 1 + lowest) << column_bits) |
                               (last_column - static_cast<uint32_t>(s.sel_pos[r]))
                         : 0;
    }
    SortByScore(s.by_score).SortDescending(item, 0, 32 + column_bits);
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
      const int r = SORT_ITEMS * threadIdx.x + i;
      if (r < topk) out[r] = r < n ? static_cast<int>(last_column - (item[i] & last_column)) : -1;
    }
  }

  // write_selection's score order for this thread's entries (key 0: padding) and its lowest and
  // highest keys: the keys relative to the selection's lowest (key - lowest + 1, padding 0: last)
  // are sorted with their columns, then each run of equal keys is put in column order.
  static __device__ void write_by_score(const uint32_t (&key)[SORT_ITEMS], const uint32_t (&pos)[SORT_ITEMS],
                                        uint32_t key_min, uint32_t key_max, int n, int topk, int column_bits,
                                        uint32_t last_column, int* out, Shared& s) {
    key_min = __reduce_min_sync(0xffffffffu, key_min);
    key_max = __reduce_max_sync(0xffffffffu, key_max);
    if ((threadIdx.x & 31) == 0) {
      atomicMin(&s.key_min, key_min);
      atomicMax(&s.key_max, key_max);
    }
    __syncthreads();
    const uint32_t lowest = s.key_min, span = s.key_max - lowest + 1;  // below 2^32: finite keys span less
    uint32_t rel[SORT_ITEMS];
    int column[SORT_ITEMS];
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
      rel[i] = key[i] != 0 ? key[i] - lowest + 1 : 0u;
      column[i] = static_cast<int>(pos[i]);
    }
    // thread t ends up with ranks THREADS * i + t: neighbouring lanes read neighbouring words below
    SortByRel(s.by_rel).SortDescendingBlockedToStriped(rel, column, 0, 32 - __clz(span));
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
      s.sel_key[THREADS * i + threadIdx.x] = rel[i];  // the lists were read before the sort
      s.sel_pos[THREADS * i + threadIdx.x] = column[i];
    }
    __syncthreads();
    bool long_run = false;  // descending keys: a run longer than TIE_RUN_MAX holds some r and r + TIE_RUN_MAX
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
      const int r = THREADS * i + threadIdx.x;
      long_run |= r + TIE_RUN_MAX < n && s.sel_key[r + TIE_RUN_MAX] == s.sel_key[r];
    }
    if (__syncthreads_or(long_run)) {  // the by_rel storage is free
      write_packed(n, topk, lowest, column_bits, last_column, out, s);
      return;
    }
#pragma unroll 1  // reads shared memory only: one copy of the searches
    for (int i = 0; i < SORT_ITEMS; ++i) {
      const int r = THREADS * i + threadIdx.x;
      if (r >= n) {
        if (r < topk) out[r] = -1;
        continue;
      }
      const uint32_t key = s.sel_key[r];  // read back: registers are scarce at 4 entries a thread
      const int column = s.sel_pos[r];
      int at = r;
      if ((r > 0 && s.sel_key[r - 1] == key) || (r + 1 < n && s.sel_key[r + 1] == key)) {
        // the run [lo, hi) holding r, at most TIE_RUN_MAX long, by binary searches; then r's place
        // in it: lo plus the run's entries of lower column (the columns are distinct)
        int lo = max(r - TIE_RUN_MAX + 1, 0), top = r;
        while (lo < top) {
          const int m = (lo + top) / 2;
          if (s.sel_key[m] == key) top = m; else lo = m + 1;
        }
        int hi = r + 1, bound = min(r + TIE_RUN_MAX, n);
        while (hi < bound) {
          const int m = (hi + bound) / 2;
          if (s.sel_key[m] == key) hi = m + 1; else bound = m;
        }
        at = lo;
        for (int j = lo; j < hi; ++j) at += s.sel_pos[j] < column;
      }
      if (at < topk) out[at] = column;
    }
  }

  // Columns of [lo, hi) that the sample reads (tiles 0, SAMPLE_STRIDE, ... from the first tile).
  static __device__ int sampled_columns(const float* row, int lo, int hi) {
    int n = 0;
    for (int base = Tile::first_tile(row, lo); base < hi; base += SAMPLE_STRIDE * Tile::SIZE)
      n += min(base + Tile::SIZE, hi) - max(base, lo);
    return n;
  }

  // The floor's rank in a sample of `sampled` of the row's `columns` columns: 5/4 * topk scaled by
  // the sample's share (which is not 1 / SAMPLE_STRIDE when the row's tiles are not a multiple of
  // it: 3 of 18 tiles put the floor too high for topk scores to reach it).
  static __device__ int floor_rank(int topk, int sampled, int columns) {
    const int64_t quarters = 4 * int64_t{columns};
    return static_cast<int>((int64_t{5} * topk * sampled + quarters - 1) / quarters);
  }

  // The floor of a long row (see the top): two digits of the sample's keys, `floor_at` (floor_rank)
  // scores down the sample; 0 for an empty sample. With a `peer` (a CTA pair sharing a row, each
  // sampling its half), every histogram is summed over the pair before its digit is picked.
  static __device__ uint32_t sample_floor(const float* row, int lo, int hi, int width, int floor_at, Shared& s,
                                          int peer = -1) {
    histogram_row(row, lo, hi, width, 0, 0, s, Tiles::kSample);
    if (peer >= 0) add_peer_histogram(BINS, peer, s);
    pick_digit(BINS, floor_at, s);
    const int high = s.digit, left = s.need - s.above;
    if (high < 0) return 0;  // an empty sample
    __syncthreads();  // every thread has read s.digit, s.need and s.above before pick_digit writes them
    histogram_row(row, lo, hi, width, 1, static_cast<uint32_t>(high), s, Tiles::kSample);
    if (peer >= 0) add_peer_histogram(1 << bits_of(1), peer, s);
    pick_digit(1 << bits_of(1), left, s);
    const uint32_t floor = ((static_cast<uint32_t>(high) << bits_of(1)) | static_cast<uint32_t>(s.digit)) << shift_of(1);
    return max(floor, 1u);
  }

  // A pair's histograms: s.select.hist[0, bins) becomes the sum of both CTAs' (cluster barriers
  // before the peer's is read and before either is overwritten).
  static __device__ void add_peer_histogram(int bins, int peer, Shared& s) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    const uint32_t* theirs = cluster.map_shared_rank(s.select.hist, peer);
    constexpr int PER = (BINS + THREADS - 1) / THREADS;
    uint32_t sum[PER];
    cluster.sync();  // the peer's histogram is complete
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int b = threadIdx.x + THREADS * i;
      sum[i] = b < bins ? s.select.hist[b] + theirs[b] : 0;
    }
    cluster.sync();  // both have read both before either writes
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int b = threadIdx.x + THREADS * i;
      if (b < bins) s.select.hist[b] = sum[i];
    }
    __syncthreads();
  }

  // The exact top-k among the candidate list's num_cand entries (all keys at or above the floor),
  // written to out.
  static __device__ void select_candidates(int num_cand, int topk, int width, bool sorted, int* out, Shared& s) {
    write_selection(0, keep_candidates(num_cand, 0, 0, topk, s), topk, width, sorted, out, s);
  }

  // A long row in one pass (see the top): the sample's floor, the candidates at or above it, the
  // exact top-k among them. False, with nothing written, when fewer than topk or more than
  // CAND_CAP keys reach the floor.
  static __device__ bool select_from_floor(const float* row, int lo, int hi, int width, int topk, bool sorted,
                                           int* out, Shared& s) {
    const uint32_t floor = sample_floor(row, lo, hi, width, floor_rank(topk, sampled_columns(row, lo, hi), hi - lo), s);
    if (floor == 0) return false;
    clear_lists(s);
    collect_from_floor(row, lo, hi, width, floor, s);
    const int num_cand = s.num_cand;
    if (num_cand < topk || num_cand > CAND_CAP) return false;
    select_candidates(num_cand, topk, width, sorted, out, s);
    return true;
  }

  // Steps 1-5 (see the top) for columns [lo, hi) of `row`.
  static __device__ void select_by_digits(const float* row_ptr, int lo, int hi, int width, int topk, bool sorted,
                                          int* out, Shared& s) {
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
    int num_sel, num_cand;
    if (count <= CAND_CAP) {
      clear_lists(s);
      gather_row(row_ptr, lo, hi, width, shift_of(level), prefix, s);
      num_sel = s.num_sel;
      num_cand = keep_candidates(s.num_cand, level + 1, prefix, left, s);
    } else {  // more than CAND_CAP scores equal to the threshold: the first `left` of them by column
      collect_row_in_order(row_ptr, lo, hi, width, prefix, left, num_sel, num_cand, s);
    }
    write_selection(num_sel, num_cand, topk, width, sorted, out, s);
  }

  // The row's [lo, hi) (whole rows without ranges; never outside the row), its out row.
  static __device__ void row_range(const int* starts, const int* ends, int width, int64_t row, int& lo, int& hi) {
    const int end = ends != nullptr ? __ldg(ends + row) : width, start = starts != nullptr ? __ldg(starts + row) : 0;
    hi = min(max(end, 0), width);
    lo = min(max(start, 0), hi);
  }

  static __device__ bool is_long(const float* row_ptr, int lo, int hi) {
    return hi - Tile::first_tile(row_ptr, lo) > (2 * SAMPLE_STRIDE - 1) * Tile::SIZE;
  }

  static __device__ void run(const float* __restrict__ logits, int64_t stride, int width,
                             const int* __restrict__ starts, const int* __restrict__ ends, int topk, bool sorted,
                             int* __restrict__ out, int64_t out_stride) {
    extern __shared__ __align__(16) unsigned char smem[];
    Shared& s = *reinterpret_cast<Shared*>(smem);
    const int64_t row = blockIdx.x;
    const float* row_ptr = logits + row * stride;
    int lo, hi;
    row_range(starts, ends, width, row, lo, hi);
    out += row * out_stride;
    if (is_long(row_ptr, lo, hi) && select_from_floor(row_ptr, lo, hi, width, topk, sorted, out, s)) return;
    select_by_digits(row_ptr, lo, hi, width, topk, sorted, out, s);
  }

  // Long rows of a batch too small to fill the SMs: a cluster of two CTAs a row, each sampling,
  // histogramming and collecting one half of it; the floor comes from the summed histograms, CTA 0
  // appends CTA 1's candidates to its own (distributed shared memory) and selects. A row that is
  // not long, or whose candidates miss [topk, CAND_CAP], is done by CTA 0 alone as run() does.
  static __device__ void run_pair(const float* __restrict__ logits, int64_t stride, int width,
                                  const int* __restrict__ starts, const int* __restrict__ ends, int topk, bool sorted,
                                  int* __restrict__ out, int64_t out_stride) {
    namespace cg = cooperative_groups;
    extern __shared__ __align__(16) unsigned char smem[];
    Shared& s = *reinterpret_cast<Shared*>(smem);
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank()), peer = rank ^ 1;
    const int64_t row = blockIdx.x / 2;
    const float* row_ptr = logits + row * stride;
    int lo, hi;
    row_range(starts, ends, width, row, lo, hi);
    out += row * out_stride;
    const bool long_row = is_long(row_ptr, lo, hi);  // the same in both CTAs, as every branch below
    if (long_row) {
      const int mid = lo + (hi - lo) / 2;
      const int half_lo = rank == 0 ? lo : mid, half_hi = rank == 0 ? mid : hi;
      const int sampled = sampled_columns(row_ptr, lo, mid) + sampled_columns(row_ptr, mid, hi);  // both halves'
      const int floor_at = floor_rank(topk, sampled, hi - lo);
      const uint32_t floor = sample_floor(row_ptr, half_lo, half_hi, width, floor_at, s, peer);
      if (floor != 0) {
        clear_lists(s);
        collect_from_floor(row_ptr, half_lo, half_hi, width, floor, s);
        const int* their_count = cluster.map_shared_rank(&s.num_cand, peer);
        cluster.sync();  // both candidate lists are complete
        const int mine = s.num_cand, theirs = *their_count;
        const int first = rank == 0 ? mine : theirs, total = mine + theirs;
        const bool fits = total >= topk && total <= CAND_CAP;
        if (fits && rank == 0) {
          const uint32_t* keys = cluster.map_shared_rank(s.select.cand_key, peer);
          const int* cols = cluster.map_shared_rank(s.select.cand_pos, peer);
          for (int c = threadIdx.x; c < theirs; c += THREADS) {
            s.select.cand_key[first + c] = keys[c];
            s.select.cand_pos[first + c] = cols[c];
          }
        }
        cluster.sync();  // CTA 1's lists are read before it exits; CTA 0's copies are visible
        if (fits) {
          if (rank == 0) select_candidates(total, topk, width, sorted, out, s);
          return;
        }
      }
    }
    if (rank == 0) select_by_digits(row_ptr, lo, hi, width, topk, sorted, out, s);
  }
};
template <int THREADS>
__global__ void __launch_bounds__(THREADS, 1024 / THREADS)
topk_kernel(const float* __restrict__ logits, int64_t stride, int width, const int* __restrict__ starts,
            const int* __restrict__ ends, int topk, bool sorted, int* __restrict__ out, int64_t out_stride) {
  TopK<THREADS>::run(logits, stride, width, starts, ends, topk, sorted, out, out_stride);
}

// One cluster of two 1024-thread CTAs a row (TopK<1024>::run_pair).
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(1024, 1)
topk_pair_kernel(const float* __restrict__ logits, int64_t stride, int width, const int* __restrict__ starts,
                 const int* __restrict__ ends, int topk, bool sorted, int* __restrict__ out, int64_t out_stride) {
  TopK<1024>::run_pair(logits, stride, width, starts, ends, topk, sorted, out, out_stride);
}

// Rows at least this wide, too few to give each CTA of a pair an SM of its own, take the pair kernel:
// the width of a long row in 1024-thread CTAs.
constexpr int64_t PAIR_MIN_WIDTH = int64_t{2 * SAMPLE_STRIDE - 1} * 1024 * VEC * LOADS + 1;

cudaError_t launch_pairs(const float* logits, int64_t stride, int64_t rows, int64_t width, const int* starts,
                         const int* ends, int64_t topk, bool sorted, int* out, int64_t out_stride, int device,
                         cudaStream_t stream) {
  const int bytes = sizeof(typename TopK<1024>::Shared);
  const cudaError_t err = opt_in_shared_memory<topk_pair_kernel>(bytes, device);
  if (err != cudaSuccess) return err;
  topk_pair_kernel<<<static_cast<unsigned>(2 * rows), 1024, bytes, stream>>>(
      logits, stride, static_cast<int>(width), starts, ends, static_cast<int>(topk), sorted, out, out_stride);
  return cudaGetLastError();
}

// Launches TopK<THREADS> over the rows of `device`; returns the CUDA error.
template <int THREADS>
cudaError_t launch(const float* logits, int64_t stride, int64_t rows, int64_t width, const int* starts, const int* ends,
                   int64_t topk, bool sorted, int* out, int64_t out_stride, int device, cudaStream_t stream) {
  const int bytes = sizeof(typename TopK<THREADS>::Shared);
  const cudaError_t err = opt_in_shared_memory<topk_kernel<THREADS>>(bytes, device);
  if (err != cudaSuccess) return err;
  topk_kernel<THREADS><<<static_cast<unsigned>(rows), THREADS, bytes, stream>>>(
      logits, stride, static_cast<int>(width), starts, ends, static_cast<int>(topk), sorted, out, out_stride);
  return cudaGetLastError();
}

constexpr int RANK_MAX_WIDTH = 4096;          // a row's order keys fit in 16 KB of shared memory
constexpr int64_t RANK_MAX_WORK = int64_t{1} << 27;  // rows x width^2 comparisons: about 10 us on an H100
constexpr int RANK_THREADS = 128;
constexpr int RANK_SPLIT = 16;                // lanes counting one column's rank, each over a 16th of the row
constexpr int RANK_COLUMNS = RANK_THREADS / RANK_SPLIT;  // columns ranked by a CTA

// Grid (ceil(width / RANK_COLUMNS), rows): CTA x ranks columns [x * RANK_COLUMNS, ...) of row y.
// Lane s of a column's RANK_SPLIT reads the row's keys in 4-key groups s, s + RANK_SPLIT, ...
// (neighbouring lanes read neighbouring 16 bytes: no bank conflict), so the row is padded with
// key 0 (never usable, never above a usable key) to a multiple of 4 * RANK_SPLIT.
__global__ void __launch_bounds__(RANK_THREADS)
rank_kernel(const float* __restrict__ logits, int64_t stride, int width, const int* __restrict__ starts,
            const int* __restrict__ ends, int topk, int* __restrict__ out, int64_t out_stride) {
  __shared__ __align__(16) uint32_t keys[RANK_MAX_WIDTH];
  __shared__ int usable;  // the row's usable scores (in range and finite)
  const int64_t row = blockIdx.y;
  const float* row_ptr = logits + row * stride;
  const int end = ends != nullptr ? __ldg(ends + row) : width, start = starts != nullptr ? __ldg(starts + row) : 0;
  const int hi = min(max(end, 0), width), lo = min(max(start, 0), hi);
  constexpr int PAD = 4 * RANK_SPLIT;
  const int padded = (width + PAD - 1) / PAD * PAD;
  if (threadIdx.x == 0) usable = 0;
  __syncthreads();
  auto key_of = [&](int j, float v) { return j >= lo && j < hi && is_finite(v) ? order_key(v) : 0u; };
  int mine = 0;
  if (reinterpret_cast<uintptr_t>(row_ptr) % 16 == 0 && width % 4 == 0) {  // 128-bit loads, none past the row
#pragma unroll 4
    for (int j = 4 * threadIdx.x; j < padded; j += 4 * RANK_THREADS) {
      const float4 v = j < width ? __ldg(reinterpret_cast<const float4*>(row_ptr + j)) : make_float4(0, 0, 0, 0);
      const uint4 k = make_uint4(key_of(j, v.x), key_of(j + 1, v.y), key_of(j + 2, v.z), key_of(j + 3, v.w));
      *reinterpret_cast<uint4*>(keys + j) = k;
      mine += (k.x != 0) + (k.y != 0) + (k.z != 0) + (k.w != 0);
    }
  } else {
#pragma unroll 8
    for (int j = threadIdx.x; j < padded; j += RANK_THREADS) {
      const uint32_t k = key_of(j, j >= lo && j < hi ? row_ptr[j] : 0.0f);
      keys[j] = k;
      mine += k != 0;
    }
  }
  if (mine) atomicAdd(&usable, mine);
  __syncthreads();

  const int lane = threadIdx.x % RANK_SPLIT, column = blockIdx.x * RANK_COLUMNS + threadIdx.x / RANK_SPLIT;
  const uint32_t key = column < width ? keys[column] : 0u;
  // j beats column: keys[j] > key, or keys[j] == key with j < column, i.e. keys[j] > key - (j < column)
  int beaten_by = 0;
  if (key != 0) {
    const uint4* groups = reinterpret_cast<const uint4*>(keys);
    for (int g = lane; g < padded / 4; g += RANK_SPLIT) {
      const uint4 q = groups[g];
      const int j = 4 * g;
      beaten_by += (q.x > key - (j < column)) + (q.y > key - (j + 1 < column)) + (q.z > key - (j + 2 < column)) +
                   (q.w > key - (j + 3 < column));
    }
  }
#pragma unroll
  for (int d = 1; d < RANK_SPLIT; d <<= 1) beaten_by += __shfl_xor_sync(0xffffffffu, beaten_by, d);
  out += row * out_stride;
  if (key != 0 && lane == 0 && beaten_by < topk) out[beaten_by] = column;
  // slots past the usable scores: -1, spread over the row's CTAs
  for (int r = usable + blockIdx.x * RANK_THREADS + threadIdx.x; r < topk; r += gridDim.x * RANK_THREADS) out[r] = -1;
}

bool rank_serves(int64_t rows, int64_t width) {
  return width <= RANK_MAX_WIDTH && rows <= 65535 && rows * width * width <= RANK_MAX_WORK;  // rows: grid y
}

}  // namespace

int indexer_topk_max_topk() { return MAX_TOPK; }

// Launches the top-k of `rows` rows of `width` fp32 scores (row r at logits + r * stride), inside
// [starts[r], ends[r]) or whole (both null), into out [rows, topk] int32 (row stride out_stride)
// on `stream` of `device`. Returns nullptr or the
// CUDA error's text. Long rows at most half the SMs take a pair of 1024-thread CTAs each; other
// rows too few for two 512-thread CTAs on every SM get one 1024-thread CTA each (measured on an H100: 128 rows x 128K 133 -> 104 us; 4096 rows x 64K 1391 -> 1829 us).
// Four 256-thread CTAs an SM ran the two-pass 4096 x 64K in 1251 us, but have no room for the
// one-pass buffer (512 threads, one pass: 1117 us).
const char* launch_indexer_topk(const float* logits, int64_t stride, int64_t rows, int64_t width, const int* starts,
                                const int* ends, int64_t topk, bool sorted, int* out, int64_t out_stride, int device,
                                void* stream) {
  if (rows == 0) return nullptr;
  int previous = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    const auto s = static_cast<cudaStream_t>(stream);
    if (rank_serves(rows, width)) {
      const dim3 grid(static_cast<unsigned>(std::max<int64_t>((width + RANK_COLUMNS - 1) / RANK_COLUMNS, 1)),
                      static_cast<unsigned>(rows));
      rank_kernel<<<grid, RANK_THREADS, 0, s>>>(logits, stride, static_cast<int>(width), starts, ends,
                                                static_cast<int>(topk), out, out_stride);
      err = cudaGetLastError();
    } else {
      err = 2 * rows <= sms && width >= PAIR_MIN_WIDTH
                ? launch_pairs(logits, stride, rows, width, starts, ends, topk, sorted, out, out_stride, device, s)
            : rows < 2 * sms
                ? launch<1024>(logits, stride, rows, width, starts, ends, topk, sorted, out, out_stride, device, s)
                : launch<512>(logits, stride, rows, width, starts, ends, topk, sorted, out, out_stride, device, s);
    }
  }
  if (previous != device) cudaSetDevice(previous);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace flashdsa
