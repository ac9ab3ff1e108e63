// FP8 block-scaled linear at decode sizes (1..4 tokens) on Hopper, in one launch: each CTA
// quantizes the activations it needs, then streams its weight rows once.
//
// Contract (flashdsa.runtime.gemm.cuda.gemv.fp8_gemv): x [m, groups*k] float, w e4m3
// [groups*n, k] with one fp32 scale per 128x128 block, out [m, groups*n] in x's dtype:
//   out[i, g*n + j] = sum_kb (sum_{c in block kb} xq[i, g*k + c] * w[g*n + j, c])
//                     * x_scale[i, g*k/128 + kb] * w_scale[(g*n + j) / 128, kb]
// with xq, x_scale exactly flashdsa.runtime.gemm.quantize_activations' e4m3 codes and scales (per
// token and 128 inputs: scale = max(amax, 1e-4) / 448 in IEEE fp32, rounded up to a power of two
// with pow2_scales; code = x / scale clamped to +-448, rounded to e4m3 ties-to-even), summed in fp32.
//
// Work: a warp streams 16 weight rows over a range of 128-input blocks with mma.sync m16n8k16
// (f16 in, fp32 out): the weight rows as the MMA's M, the tokens as its N (8, zeros past m). Per
// block a lane loads 16 bytes of each half (64 inputs) of rows g and g+8 (g = lane / 4; lane t =
// lane % 4 takes bytes 16t..16t+15 of each half), widens every 2 bytes to an f16 pair (cvt
// e4m3x2 -> f16x2, exact) and feeds 4 bytes of each row as one MMA's A: the MMA's K order is a
// per-lane permutation of the inputs (its k 2t, 2t+1, 2t+8, 2t+9 are the lane's 4 consecutive
// inputs), which B follows (token g's activations at the lane's own positions, as f16 codes in
// shared memory). f16 products of e4m3 values are exact and the MMA sums them in fp32 (no fp16
// arithmetic); each block's sums are scaled by w_scale * x_scale and accumulated in fp32. STAGES
// blocks (4 x 16-byte loads a lane each, L1 bypassed) are in flight per warp.
//
// A CTA is 8 warps on 16 * row_tiles rows (within one weight-scale block and one group) and a
// range of K blocks, split between its 8 / row_tiles warps along K; a cluster of up to 8 CTAs
// splits K further. First each CTA issues its warps' first loads, then quantizes the activations
// of its K range into shared memory (16 threads a group of 128 inputs, 64 bytes of x a thread
// in flight), so the quantization overlaps the weights' latency. At the end the warps' sums go
// through shared memory (sum over the CTA's warps), and each CTA of the cluster writes its share
// of the outputs, summing the cluster's CTAs in rank order through distributed shared memory: a
// fixed order (the result does not depend on timing), no atomics and no global workspace, so a
// call can be captured in a CUDA graph. The launch shape comes from the shape and the SM count
// alone (launch_shape below).

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gemv.h"
#include "stream_load.cuh"

namespace flashdsa {
namespace {

namespace cg = cooperative_groups;

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int GROUP = kFp8GemvGroup;
constexpr int TOKENS = kFp8GemvMaxM;     // token slots in shared memory (the MMA's N is 8: zeros past m)
constexpr int TILE_ROWS = 16;            // weight rows a warp streams: the MMA's M
constexpr int STAGES = 4;                // K blocks of weights in flight per warp
constexpr int MAX_CLUSTER = 8;           // CTAs splitting K (the portable cluster size)
constexpr int MAX_CTA_BLOCKS = kFp8GemvMaxK / GROUP / MAX_CLUSTER;  // K blocks per CTA
constexpr int QUANT_LANES = GROUP / 8;   // threads quantizing one group of 128 inputs, 8 each
constexpr int QUANT_GROUPS = THREADS / QUANT_LANES;  // groups per pass of the CTA
constexpr int QUANT_BYTES = 32;          // bytes of x a thread has in flight (2 passes of bf16/fp16, 1 of fp32)
constexpr int X_ROW_PAD = 16;            // bytes after each token's codes: conflict-free 16-byte reads
constexpr int WARP_SUMS = WARPS * TILE_ROWS * TOKENS;  // floats of per-warp sums (any row_tiles)
constexpr float AMAX_FLOOR = 1e-4f;
constexpr float E4M3_MAX = 448.f;
constexpr unsigned FULL = 0xffffffffu;
static_assert(TILE_ROWS * WARPS <= GROUP, "a CTA's rows must share one weight-scale block");

struct Params : Fp8GemvArgs {
  int rows;        // groups * n
  int k_blocks;    // k / 128
  int row_tiles;   // 16-row tiles per CTA; its other WARPS / row_tiles warps split its K range
  int cluster;     // CTAs splitting K: one cluster
  int cta_blocks;  // K blocks per CTA (the last CTAs of a cluster may have fewer)
  bool x_vectors;  // every 8 inputs of x start on a 16-byte boundary: 16-byte loads
};

// e4m3 bytes b0..b3 of q -> the f16 pairs (b0, b1) and (b2, b3), exactly.
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t q, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(q));
}

// q = x / scale clamped to +-448 and rounded to e4m3 (ties to even): torch's float8_e4m3fn cast,
// in integer arithmetic on the fp32 bits (the e4m3 byte).
__device__ __forceinline__ uint32_t e4m3_code(float q) {
  q = fminf(fmaxf(q, -E4M3_MAX), E4M3_MAX);
  const uint32_t bits = __float_as_uint(q), mag = bits & 0x7FFFFFFFu;
  // normal (>= 2^-6): drop 20 of the 23 mantissa bits with round-half-even, rebias 127 -> 7
  const uint32_t normal = ((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - ((127u - 7u) << 3);
  // subnormal: the nearest multiple of 2^-9 (the fp32 add rounds to even)
  const uint32_t subnormal = __float_as_uint(fabsf(q) * 512.f + 8388608.f) - 0x4B000000u;
  return (mag >= 0x3C800000u ? normal : subnormal) | ((bits >> 24) & 0x80u);
}

// 8 consecutive inputs of x as loaded (8 * sizeof(T) bytes): one 16-byte load (two for fp32) when
// aligned, else one load an input; widened to fp32 (exactly) when quantized.
template <typename T>
struct Raw8 {
  uint4 part[sizeof(T) / 2];
};

template <typename T>
__device__ __forceinline__ Raw8<T> load8(const T* p, bool vector) {
  Raw8<T> raw;
  if (vector) {
#pragma unroll
    for (int i = 0; i < int(sizeof(T)) / 2; ++i) raw.part[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
  } else {
    T* v = reinterpret_cast<T*>(raw.part);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldg(p + j);
  }
  return raw;
}

__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(float v) { return v; }

template <typename T>
__device__ __forceinline__ void widen8(const Raw8<T>& raw, float (&v)[8]) {
  const T* x = reinterpret_cast<const T*>(raw.part);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = widen(x[j]);
}

__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

// One lane's 8 inputs of a group of 128 (its 16 lanes call together) -> the group's scale, and
// the lane's e4m3 codes as 8 f16 (exact).
__device__ __forceinline__ float quantize8(const float (&v)[8], bool pow2, uint4& codes) {
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int offset = QUANT_LANES / 2; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, offset));
  float scale = __fdiv_rn(fmaxf(amax, AMAX_FLOOR), E4M3_MAX);
  uint32_t c[8];
  if (pow2) {  // the smallest power of two >= scale, from its bits; 1 / 2^e is exact, so x * it is x / 2^e
    const uint32_t bits = __float_as_uint(scale);
    scale = __uint_as_float(((bits >> 23) + ((bits & 0x7FFFFFu) != 0u)) << 23);
    const float inverse = __fdiv_rn(1.f, scale);
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = e4m3_code(v[j] * inverse);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = e4m3_code(__fdiv_rn(v[j], scale));
  }
  e4m3x4_to_f16x2(c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24), codes.x, codes.y);
  e4m3x4_to_f16x2(c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24), codes.z, codes.w);
  return scale;
}

// Quantize x[0:m, group*k + kb0*128 :][: cta_blocks*128] into x_codes ([m][x_row bytes], f16
// codes) and x_scale ([cta_blocks][TOKENS], zeros for tokens >= m).
template <typename T>
__device__ __forceinline__ void stage_activations(const Params& p, int group, int kb0, int cta_blocks,
                                                  uint8_t* x_codes, int x_row, float* x_scale) {
  const T* x = static_cast<const T*>(p.x) + int64_t(group) * p.k + kb0 * GROUP;
  const int lane = threadIdx.x % QUANT_LANES, count = p.m * cta_blocks;
  constexpr int BATCH = QUANT_BYTES / (8 * int(sizeof(T)));  // passes whose loads are in flight together
  for (int first = 0; first < count; first += BATCH * QUANT_GROUPS) {
    Raw8<T> raw[BATCH];
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const int q = first + i * QUANT_GROUPS + static_cast<int>(threadIdx.x) / QUANT_LANES;
      const T* src = x + (q / cta_blocks) * p.stride_x + (q % cta_blocks) * GROUP + 8 * lane;
      raw[i] = q < count ? load8(src, p.x_vectors) : Raw8<T>{};
    }
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      if (first + i * QUANT_GROUPS >= count) break;  // uniform: every lane of the CTA stops here
      const int q = first + i * QUANT_GROUPS + static_cast<int>(threadIdx.x) / QUANT_LANES;
      float v[8];
      widen8(raw[i], v);
      uint4 codes;
      const float scale = quantize8(v, p.pow2_scales, codes);
      if (q < count) {
        const int token = q / cta_blocks, block = q % cta_blocks;
        *reinterpret_cast<uint4*>(x_codes + token * x_row + block * GROUP * 2 + 16 * lane) = codes;
        if (lane == 0) x_scale[block * TOKENS + token] = scale;
      }
    }
  }
  for (int i = threadIdx.x; i < cta_blocks * TOKENS; i += THREADS)
    if (i % TOKENS >= p.m) x_scale[i] = 0.f;
}

// d += A (rows g, g+8: two f16 pairs each) x B (this lane's token: two f16 pairs).
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Half a block (64 inputs): row_g / row_g8 hold 16 weight bytes of rows g and g+8, x_lo / x_hi the
// lane token's 16 codes at the same positions (4 MMAs, one per 4 bytes).
__device__ __forceinline__ void dot_half(const uint4& row_g, const uint4& row_g8, const uint4& x_lo,
                                         const uint4& x_hi, float (&d)[4]) {
  const uint32_t wg[4] = {row_g.x, row_g.y, row_g.z, row_g.w}, wg8[4] = {row_g8.x, row_g8.y, row_g8.z, row_g8.w};
  const uint32_t x[8] = {x_lo.x, x_lo.y, x_lo.z, x_lo.w, x_hi.x, x_hi.y, x_hi.z, x_hi.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t a[4];  // the MMA's (row g, k 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..)
    e4m3x4_to_f16x2(wg[j], a[0], a[2]);
    e4m3x4_to_f16x2(wg8[j], a[1], a[3]);
    mma_f16(d, a, x[2 * j], x[2 * j + 1]);
  }
}

template <typename T>
__global__ void __launch_bounds__(THREADS, 2) fp8_gemv_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  float* warp_sums = reinterpret_cast<float*>(smem);  // [WARPS / row_tiles][cta_rows][TOKENS]
  float* cta_sums = warp_sums + WARP_SUMS;            // [cta_rows][TOKENS]: this CTA's K range
  float* x_scale = cta_sums + WARP_SUMS;              // [cta_blocks][TOKENS]
  uint8_t* x_codes = reinterpret_cast<uint8_t*>(x_scale + p.cta_blocks * TOKENS);  // [m][x_row bytes]
  const int x_row = p.cta_blocks * GROUP * 2 + X_ROW_PAD;

  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int cta_rows = p.row_tiles * TILE_ROWS, k_warps = WARPS / p.row_tiles;
  const int row0 = static_cast<int>(blockIdx.x) / p.cluster * cta_rows;
  const int kb0 = rank * p.cta_blocks;
  const int cta_blocks = max(0, min(p.cta_blocks, p.k_blocks - kb0));

  // this warp: rows [r0, r0 + 16), blocks [wb0, wb0 + blocks) of the CTA's range
  const int tile = warp % p.row_tiles, slice = warp / p.row_tiles;
  const int r0 = row0 + tile * TILE_ROWS;
  const int per_warp = (cta_blocks + k_warps - 1) / k_warps, wb0 = slice * per_warp;
  const int blocks = r0 < p.rows ? max(0, min(per_warp, cta_blocks - wb0)) : 0;
  const int64_t row_g = min(r0 + g, p.rows - 1), row_g8 = min(r0 + g + 8, p.rows - 1);  // past the end: repeats
  const int64_t k_offset = int64_t(kb0 + wb0) * GROUP + 16 * t;
  const uint8_t* w_g = p.w + row_g * p.k + k_offset;
  const uint8_t* w_g8 = p.w + row_g8 * p.k + k_offset;
  const float* w_scale = p.w_scale + (row0 / GROUP) * p.stride_w_scale + kb0 + wb0;

  uint4 stage[STAGES][4];  // rows g, g+8 inputs [16t, +16); rows g, g+8 inputs [64 + 16t, +16)
  float stage_scale[STAGES];
  auto fetch = [&](int s, int b) {
    const int offset = b * GROUP;
    stage[s][0] = load_stream(w_g + offset);
    stage[s][1] = load_stream(w_g8 + offset);
    stage[s][2] = load_stream(w_g + offset + GROUP / 2);
    stage[s][3] = load_stream(w_g8 + offset + GROUP / 2);
    stage_scale[s] = __ldg(w_scale + b);
  };
#pragma unroll
  for (int s = 0; s < STAGES; ++s)
    if (s < blocks) fetch(s, s);

  stage_activations<T>(p, row0 / p.n, kb0, cta_blocks, x_codes, x_row, x_scale);
  __syncthreads();

  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // (row g, token 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
  const uint8_t* x_lane = x_codes + g * x_row + 32 * t;  // token g's codes at this lane's positions
  for (int b0 = 0; b0 < blocks; b0 += STAGES) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int b = b0 + s;
      if (b >= blocks) break;
      const int cb = wb0 + b;
      uint4 x[4] = {};
      if (g < p.m) {
        const uint4* src = reinterpret_cast<const uint4*>(x_lane + cb * GROUP * 2);
        x[0] = src[0], x[1] = src[1], x[2] = src[GROUP / 16], x[3] = src[GROUP / 16 + 1];
      }
      float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
      dot_half(stage[s][0], stage[s][1], x[0], x[1], lo);
      dot_half(stage[s][2], stage[s][3], x[2], x[3], hi);
      float f0 = 0.f, f1 = 0.f;
      if (t < TOKENS / 2) {
        const float2 xs = *reinterpret_cast<const float2*>(x_scale + cb * TOKENS + 2 * t);
        f0 = stage_scale[s] * xs.x;
        f1 = stage_scale[s] * xs.y;
      }
      if (b + STAGES < blocks) fetch(s, b + STAGES);  // into the registers just read
      acc[0] = fmaf(lo[0] + hi[0], f0, acc[0]);
      acc[1] = fmaf(lo[1] + hi[1], f1, acc[1]);
      acc[2] = fmaf(lo[2] + hi[2], f0, acc[2]);
      acc[3] = fmaf(lo[3] + hi[3], f1, acc[3]);
    }
  }

  if (t < TOKENS / 2) {
    float* dst = warp_sums + (slice * cta_rows + tile * TILE_ROWS + g) * TOKENS + 2 * t;
    *reinterpret_cast<float2*>(dst) = make_float2(acc[0], acc[1]);
    *reinterpret_cast<float2*>(dst + 8 * TOKENS) = make_float2(acc[2], acc[3]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < cta_rows * TOKENS; i += THREADS) {
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < WARPS; ++s)
      if (s < k_warps) sum += warp_sums[s * cta_rows * TOKENS + i];
    cta_sums[i] = sum;
  }
  cluster.sync();  // every CTA's sums are written (and visible across the cluster)

  T* out = static_cast<T*>(p.out);
  for (int i = rank * THREADS + threadIdx.x; i < cta_rows * p.m; i += p.cluster * THREADS) {
    const int token = i / cta_rows, r = i % cta_rows;
    if (row0 + r >= p.rows) continue;
    float part[MAX_CLUSTER];
#pragma unroll
    for (int c = 0; c < MAX_CLUSTER; ++c)
      part[c] = c < p.cluster ? cluster.map_shared_rank(cta_sums, c)[r * TOKENS + token] : 0.f;
    float sum = part[0];
#pragma unroll
    for (int c = 1; c < MAX_CLUSTER; ++c) sum += part[c];
    store(out + token * p.stride_out + row0 + r, sum);
  }
  if (p.cluster > 1) cluster.sync();  // no CTA leaves while another reads its shared memory
}

struct LaunchShape {
  int row_tiles, cluster, cta_blocks;
};

// The fewest CTAs per output row (cluster) and the most rows per CTA (row_tiles: each CTA
// quantizes the activations of its K range once for all its rows) that still put a CTA on 7/8 of
// the SMs, with at most MAX_CTA_BLOCKS K blocks per CTA (shared memory). Shapes too small for that
// get 16-row CTAs and the widest cluster their K allows.
LaunchShape launch_shape(int rows, int k_blocks, int sms) {
  const int tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
  for (int row_tiles = WARPS; row_tiles >= 1; row_tiles /= 2) {
    if (row_tiles > 1 && row_tiles > tiles) continue;
    const int ctas = (tiles + row_tiles - 1) / row_tiles;
    for (int cluster = 1; cluster <= MAX_CLUSTER && cluster <= k_blocks; cluster *= 2) {
      const int cta_blocks = (k_blocks + cluster - 1) / cluster;
      if (cta_blocks <= MAX_CTA_BLOCKS && 8 * ctas * cluster >= 7 * sms) return {row_tiles, cluster, cta_blocks};
    }
  }
  int cluster = 1;
  while (2 * cluster <= MAX_CLUSTER && 2 * cluster <= k_blocks) cluster *= 2;
  return {1, cluster, (k_blocks + cluster - 1) / cluster};
}

template <typename T>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  const int ctas = (p.rows + p.row_tiles * TILE_ROWS - 1) / (p.row_tiles * TILE_ROWS);
  const size_t smem = sizeof(float) * (2 * WARP_SUMS + p.cta_blocks * TOKENS) +
                      size_t(p.m) * (p.cta_blocks * GROUP * 2 + X_ROW_PAD);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = p.cluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas * p.cluster);
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = smem;  // at most 37.4 KB: no opt-in needed
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, fp8_gemv_kernel<T>, p);
}

int element_size(GemvDtype dtype) { return dtype == GemvDtype::kFp32 ? 4 : 2; }

}  // namespace

const char* launch_fp8_gemv(const Fp8GemvArgs& args, int device, void* stream) {
  if (args.m < 1 || args.m > kFp8GemvMaxM || args.k < GROUP || args.k % GROUP || args.k > kFp8GemvMaxK ||
      args.groups < 1 || args.n < 1 || (args.groups > 1 && args.n % GROUP))
    return "fp8_gemv: m must be in [1, 4], k a multiple of 128 in [128, 32768], n >= 1 (a multiple of 128 "
           "when groups > 1)";
  int previous = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    Params p;
    static_cast<Fp8GemvArgs&>(p) = args;
    p.rows = args.groups * args.n;
    p.k_blocks = args.k / GROUP;
    const LaunchShape shape = launch_shape(p.rows, p.k_blocks, sms);
    p.row_tiles = shape.row_tiles;
    p.cluster = shape.cluster;
    p.cta_blocks = shape.cta_blocks;
    const int size = element_size(args.dtype);
    p.x_vectors = reinterpret_cast<uintptr_t>(args.x) % 16 == 0 && (args.m == 1 || args.stride_x * size % 16 == 0);
    const auto s = static_cast<cudaStream_t>(stream);
    switch (args.dtype) {
      case GemvDtype::kBf16: err = launch<__nv_bfloat16>(p, s); break;
      case GemvDtype::kFp16: err = launch<__half>(p, s); break;
      case GemvDtype::kFp32: err = launch<float>(p, s); break;
    }
    if (err == cudaSuccess) err = cudaGetLastError();
  }
  if (previous != device) cudaSetDevice(previous);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace flashdsa
