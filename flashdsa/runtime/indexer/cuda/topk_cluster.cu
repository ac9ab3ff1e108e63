// Indexer top-k for rows that fit in shared memory: a thread-block cluster of `ranks` CTAs per row
// (sm_90), each holding one slice of the row as 32-bit order keys, so the row is read from global
// memory once and every later pass reads shared memory. Same contract as topk.cu's kernel.
//
// Per row (slices [base + r * len, base + (r + 1) * len) for rank r; base the 16-byte aligned
// column at or below the range's start, len a multiple of VEC):
//  1. each CTA loads its slice (128-bit loads), stores the keys (0: out of range or not finite)
//     and histograms their top 11 bits;
//  2. per digit (11, 11, 10 bits): every CTA sums the cluster's histograms over distributed shared
//     memory and picks the same bin (the one holding the need-th largest), then histograms the
//     next digit of its keys in that bin; it stops early once the whole bin is taken;
//  3. each CTA counts its keys above the threshold and level with it; from the counts of the
//     lower ranks it knows where its selection starts in column order, and writes it there: the
//     columns (unsorted), or (key, column) into rank 0's shared memory (sorted);
//  4. sorted: rank 0 sorts the selection by key, descending, stably (equal keys stay in column
//     order, so the lower column wins), and writes it; unsorted: rank 0 writes the -1 padding.
// Every decision after a cluster barrier depends on cluster-wide sums only, so all CTAs of a
// cluster take the same branches and meet at the same barriers. Histogram atomics are aggregated
// per warp (__match_any_sync): normal scores crowd a few top-11-bit bins.

#include <cooperative_groups.h>

#include "topk_common.cuh"

namespace cg = cooperative_groups;

namespace flashdsa {
namespace {

constexpr int SLICE_CAP = 20480;  // keys per CTA: two CTAs per SM; 7 CTAs cover a 128K-column row
constexpr int STEP = THREADS * VEC;  // keys per block-wide step: thread t takes keys [VEC t, VEC t + VEC)
constexpr int BATCH = 4;             // 128-bit loads in flight per thread while loading the slice
constexpr int MIN_SLICE = STEP;      // a cluster is not widened past slices of this many keys
constexpr int WARP_STEP = 32 * VEC;  // keys per warp-wide step of the collect pass

struct ClusterShared {
  union {
    uint32_t key[SLICE_CAP];       // the slice's order keys (0: never selected)
    typename Sort::TempStorage sort;  // rank 0, once its slice is collected
  };
  uint32_t hist[2][BINS];            // digit `level` counts in hist[level % 2], read by the whole cluster
  uint32_t gather_key[MAX_TOPK];     // rank 0, sorted output: the cluster's selection in column order
  int gather_pos[MAX_TOPK];
  int2 warp_counts[WARPS];           // per warp: keys above the threshold, level with it
  int2 counts;                       // this CTA's: keys above the threshold, level with it (read by the cluster)
  Scratch scratch;
};

static_assert(sizeof(ClusterShared) <= 113 * 1024, "two CTAs per SM need at most 113 KB of shared memory each");
static_assert(sizeof(typename Sort::TempStorage) <= sizeof(uint32_t) * SLICE_CAP, "the sort overlays the keys");

// Columns per slice when `span` columns are split over `ranks` CTAs: a multiple of VEC, so every
// slice starts 16-byte aligned.
__host__ __device__ constexpr int slice_len(int span, int ranks) {
  return (span + ranks * VEC - 1) / (ranks * VEC) * VEC;
}

// Adds 1 to hist[bin] for every lane with `active`; lanes with equal bins add once, together
// (same-address shared atomics serialize). Call with the whole warp.
__device__ __forceinline__ void warp_count(uint32_t* hist, uint32_t bin, bool active) {
  if (__ballot_sync(0xffffffffu, active) == 0) return;
  const unsigned peers = __match_any_sync(0xffffffffu, active ? bin : 0xffffffffu);  // no bin is ~0
  if (active && static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
}

// Step 1: keys [0, len) of columns begin + j, and their top digit counted into hist (zeroed).
__device__ void load_slice(const float* row, int begin, int len, int lo, int hi, int width, ClusterShared& s) {
  for (int j0 = 0; j0 < len; j0 += STEP * BATCH) {  // block-uniform trip count: warp_count needs whole warps
    uint32_t key[BATCH][VEC];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = j0 + b * STEP + VEC * static_cast<int>(threadIdx.x);
#pragma unroll
      for (int i = 0; i < VEC; ++i) key[b][i] = 0u;
      if (j < len) load_keys(row, begin + j, lo, hi, width, key[b]);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = j0 + b * STEP + VEC * static_cast<int>(threadIdx.x);
      if (j < len) *reinterpret_cast<uint4*>(&s.key[j]) = make_uint4(key[b][0], key[b][1], key[b][2], key[b][3]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) warp_count(s.hist[0], key[b][i] >> shift_of(0), key[b][i] != 0u);
    }
  }
}

// Digit `level` (> 0) of the slice's keys whose higher digits equal `prefix`, counted into hist (zeroed).
// Key 0 never matches: prefix holds a finite key's top digit, which is >= 4.
__device__ void histogram_slice(int len, int level, uint32_t prefix, uint32_t* hist, const ClusterShared& s) {
  const int shift = shift_of(level), above_shift = shift_of(level - 1);
  const uint32_t mask = (1u << bits_of(level)) - 1u;
  for (int j0 = 0; j0 < len; j0 += STEP) {
    const int j = j0 + VEC * static_cast<int>(threadIdx.x);
    const uint4 v = j < len ? *reinterpret_cast<const uint4*>(&s.key[j]) : make_uint4(0u, 0u, 0u, 0u);
    const uint32_t key[VEC] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < VEC; ++i) warp_count(hist, (key[i] >> shift) & mask, (key[i] >> above_shift) == prefix);
  }
}

// The bin of digit `level` holding the need-th largest key of the whole row (hist summed over the cluster).
__device__ Digit pick_cluster_digit(const cg::cluster_group& cluster, int ranks, int level, int need, ClusterShared& s) {
  uint32_t* hist = s.hist[level & 1];
  return pick_digit(1 << bits_of(level), need, s.scratch, [&](int b) {
    uint32_t sum = 0;
#pragma unroll
    for (int r = 0; r < MAX_CLUSTER; ++r)
      if (r < ranks) sum += cluster.map_shared_rank(hist, r)[b];
    return sum;
  });
}

// Step 3: writes this CTA's selection (keys whose bits from `shift` up are above `prefix`, and the
// first `take_equal` of the row level with it) at its column-order ranks: into out (unsorted) or
// rank 0's gather lists (sorted). Warp w scans keys [w * chunk, (w + 1) * chunk) of the slice.
__device__ void collect_slice(const cg::cluster_group& cluster, int rank, int begin, int len, int shift,
                              uint32_t prefix, int take_equal, bool sorted, int* out, ClusterShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk = (len + WARPS * WARP_STEP - 1) / (WARPS * WARP_STEP) * WARP_STEP;
  const int warp_begin = min(len, warp * chunk), warp_end = min(len, warp_begin + chunk);
  int above = 0, equal = 0;  // key 0 is neither: prefix >= 4 > 0 >> shift
  for (int j = warp_begin + VEC * lane; j < warp_end; j += WARP_STEP) {
    const uint4 v = *reinterpret_cast<const uint4*>(&s.key[j]);
    const uint32_t key[VEC] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      above += (key[i] >> shift) > prefix;
      equal += (key[i] >> shift) == prefix;
    }
  }
  above = __reduce_add_sync(0xffffffffu, above);
  equal = __reduce_add_sync(0xffffffffu, equal);
  if (lane == 0) s.warp_counts[warp] = make_int2(above, equal);
  __syncthreads();
  int2 before = make_int2(0, 0), total = make_int2(0, 0);
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const int2 c = s.warp_counts[w];
    if (w < warp) { before.x += c.x; before.y += c.y; }
    total.x += c.x; total.y += c.y;
  }
  if (threadIdx.x == 0) s.counts = total;
  cluster.sync();  // every CTA's counts are published
  for (int r = 0; r < rank; ++r) {
    const int2 c = *cluster.map_shared_rank(&s.counts, r);
    before.x += c.x; before.y += c.y;
  }
  // before: keys above / level of the whole row in columns ahead of this warp's first key. A key
  // above goes to rank above_before + min(equal_before, take_equal), a level one (when among the
  // first take_equal) to above_before + equal_before; the ranks stay below need <= MAX_TOPK.
  uint32_t* gather_key = cluster.map_shared_rank(s.gather_key, 0);
  int* gather_pos = cluster.map_shared_rank(s.gather_pos, 0);
  auto emit = [&](int at, uint32_t key, int column) {
    if (sorted) {
      gather_key[at] = key;
      gather_pos[at] = column;
    } else {
      out[at] = column;
    }
  };
  for (int j0 = warp_begin; j0 < warp_end; j0 += WARP_STEP) {  // warp-uniform trip count (shuffles)
    const int j = j0 + VEC * lane;
    const uint4 v = j < warp_end ? *reinterpret_cast<const uint4*>(&s.key[j]) : make_uint4(0u, 0u, 0u, 0u);
    const uint32_t key[VEC] = {v.x, v.y, v.z, v.w};
    int packed = 0;  // keys above in the low 16 bits, level in the high 16 (at most WARP_STEP each)
#pragma unroll
    for (int i = 0; i < VEC; ++i) packed += ((key[i] >> shift) > prefix) + (((key[i] >> shift) == prefix) << 16);
    int inclusive = packed;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += x;
    }
    int a = before.x + ((inclusive - packed) & 0xffff), e = before.y + ((inclusive - packed) >> 16);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const uint32_t high = key[i] >> shift;
      if (high > prefix) {
        emit(a + min(e, take_equal), key[i], begin + j + i);
        ++a;
      } else if (high == prefix) {
        if (e < take_equal) emit(a + e, key[i], begin + j + i);
        ++e;
      }
    }
    const int step_total = __shfl_sync(0xffffffffu, inclusive, 31);
    before.x += step_total & 0xffff;
    before.y += step_total >> 16;
  }
}

__global__ void __launch_bounds__(THREADS, 2)
cluster_topk_kernel(const float* __restrict__ logits, int64_t stride, int width, const int* __restrict__ starts,
                    const int* __restrict__ ends, int topk, bool sorted, int* __restrict__ out, int64_t out_stride) {
  extern __shared__ __align__(16) unsigned char smem[];
  ClusterShared& s = *reinterpret_cast<ClusterShared*>(smem);
  const cg::cluster_group cluster = cg::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / ranks;
  const float* row_ptr = logits + row * stride;
  const int hi = min(max(ends[row], 0), width), lo = min(max(starts[row], 0), hi);  // never outside the row
  const int base = first_aligned_column(row_ptr, lo);
  const int len = slice_len(hi - base, ranks);  // <= slice_len(width + 3, ranks) <= SLICE_CAP (host check)
  const int begin = base + rank * len;
  out += row * out_stride;

  for (int b = threadIdx.x; b < BINS; b += THREADS) s.hist[0][b] = 0;
  __syncthreads();
  load_slice(row_ptr, begin, len, lo, hi, width, s);
  uint32_t prefix = 0;
  int need = topk, left = topk, shift = 0;
  for (int level = 0; level < LEVELS; ++level) {
    if (level > 0) {
      for (int b = threadIdx.x; b < BINS; b += THREADS) s.hist[level & 1][b] = 0;  // last read at level - 2
      __syncthreads();
      histogram_slice(len, level, prefix, s.hist[level & 1], s);
    }
    cluster.sync();  // every CTA's histogram of this digit is complete
    const Digit d = pick_cluster_digit(cluster, ranks, level, left, s);
    if (level == 0) need = left = d.need;  // need: topk capped at the row's usable scores
    if (need == 0) break;
    prefix = (prefix << bits_of(level)) | static_cast<uint32_t>(d.digit);
    shift = shift_of(level);
    left -= d.above;
    if (d.count == left) break;  // the whole bin is taken: its lower digits decide nothing
  }
  if (need > 0) collect_slice(cluster, rank, begin, len, shift, prefix, left, sorted, out, s);
  cluster.sync();  // the gather is complete, and no CTA's shared memory is read after this
  if (rank != 0) return;
  if (sorted && need > 0) {
    write_sorted(need, topk, out, s.sort, [&](int r, uint32_t& key, int& pos) {
      key = s.gather_key[r];
      pos = s.gather_pos[r];
    });
  } else {
    for (int r = need + threadIdx.x; r < topk; r += THREADS) out[r] = -1;
  }
}

}  // namespace

int cluster_topk_ranks(int64_t rows, int64_t width, int sms) {
  int ranks = 1;
  while (ranks <= MAX_CLUSTER && slice_len(static_cast<int>(width) + 3, ranks) > SLICE_CAP) ++ranks;
  if (ranks > MAX_CLUSTER) return 0;
  while (ranks < MAX_CLUSTER && rows * ranks < 2 * sms && slice_len(static_cast<int>(width) + 3, ranks + 1) >= MIN_SLICE)
    ++ranks;
  return rows * ranks <= INT32_MAX ? ranks : 0;
}

cudaError_t launch_cluster_topk(int ranks, const float* logits, int64_t stride, int64_t rows, int64_t width,
                                const int* starts, const int* ends, int64_t topk, bool sorted, int* out,
                                int64_t out_stride, cudaStream_t stream) {
  const int bytes = sizeof(ClusterShared);
  cudaError_t err = cudaFuncSetAttribute(cluster_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute cluster_dims;
  cluster_dims.id = cudaLaunchAttributeClusterDimension;
  cluster_dims.val.clusterDim.x = static_cast<unsigned>(ranks);
  cluster_dims.val.clusterDim.y = 1;
  cluster_dims.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(rows * ranks));
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = bytes;
  config.stream = stream;
  config.attrs = &cluster_dims;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, cluster_topk_kernel, logits, stride, static_cast<int>(width), starts, ends,
                            static_cast<int>(topk), sorted, out, out_stride);
}

}  // namespace flashdsa
