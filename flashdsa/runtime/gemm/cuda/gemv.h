// Arguments of the native FP8 decode GEMV (gemv.cu), shared with its torch op (gemv_op.cpp).
// Plain C++: no CUDA or torch header, so both sides compile anywhere.
#pragma once

#include <cstdint>

namespace flashdsa {

enum class GemvDtype : int { kBf16, kFp16, kFp32 };  // of x and out

// out[m, g*n + j] = sum_k dequant(x)[m, g*k + k'] * dequant(w)[g*n + j, k'] (see gemv.cu).
struct Fp8GemvArgs {
  const void* x;            // [m, groups * k] bf16/fp16/fp32, unit column stride
  int64_t stride_x;         // elements between rows of x
  const uint8_t* w;         // e4m3 [groups * n, k], contiguous, 16-byte aligned
  const float* w_scale;     // [ceil(groups * n / 128), k / 128], unit last stride
  int64_t stride_w_scale;   // elements between rows of w_scale
  void* out;                // [m, groups * n] in x's dtype, unit column stride
  int64_t stride_out;       // elements between rows of out
  int m, n, k, groups;      // n: weight rows per group (a multiple of 128 when groups > 1)
  GemvDtype dtype;
  bool pow2_scales;         // activation scales rounded up to powers of two (ue8m0)
};

constexpr int kFp8GemvMaxM = 4;        // tokens
constexpr int kFp8GemvGroup = 128;     // inputs per activation scale; weight-scale block edge
constexpr int kFp8GemvMaxK = 32768;    // inputs per group: at most 8 CTAs of 32 blocks split it

// Launches on `stream` of `device`; nullptr or the CUDA error's text.
const char* launch_fp8_gemv(const Fp8GemvArgs& args, int device, void* stream);

}  // namespace flashdsa
