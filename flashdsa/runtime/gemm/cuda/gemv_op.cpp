// torch.ops.flashdsa.fp8_gemv_cuda: check the tensors, then launch gemv.cu's kernel. CUDA-free on
// purpose (the stream comes from Python), so it compiles against any torch build.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "gemv.h"

namespace flashdsa {

namespace {

constexpr int64_t kGroup = kFp8GemvGroup;

GemvDtype gemv_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat, "x must be bf16, fp16 or fp32, got ",
              dtype);
  return dtype == at::kBFloat16 ? GemvDtype::kBf16 : dtype == at::kHalf ? GemvDtype::kFp16 : GemvDtype::kFp32;
}

// x: [M, groups*K] bf16/fp16/fp32 (unit column stride, any row stride), M in [1, 4];
// w: [groups*N, K] float8_e4m3fn, contiguous, K a multiple of 128 in [128, 32768] (N a multiple
// of 128 when groups > 1); w_scale: [ceil(groups*N/128), K/128] fp32 with unit last stride;
// out: [M, groups*N] in x's dtype with unit column stride, written whole.
void fp8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, int64_t groups,
              bool pow2_scales, at::Tensor& out, int64_t stream) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CUDA [M, groups*K] tensor with unit column stride, got ", x.sizes(), " strides ",
              x.strides(), " on ", x.device());
  const GemvDtype dtype = gemv_dtype(x.scalar_type());
  const int64_t m = x.size(0);
  TORCH_CHECK(m >= 1 && m <= kFp8GemvMaxM, "x must have 1 to ", kFp8GemvMaxM, " rows (tokens), got ", m);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat8_e4m3fn && w.is_contiguous() &&
                  w.device() == x.device(),
              "w must be a contiguous float8_e4m3fn [groups*N, K] tensor on ", x.device(), ", got ", w.scalar_type(),
              " ", w.sizes(), " strides ", w.strides(), " on ", w.device());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "w must start on a 16-byte boundary (16-byte loads), got address ", w.data_ptr());
  const int64_t rows = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kGroup == 0 && k >= kGroup && k <= kFp8GemvMaxK, "K must be a multiple of ", kGroup, " in [",
              kGroup, ", ", kFp8GemvMaxK, "], got ", k);
  TORCH_CHECK(groups >= 1 && rows >= groups && rows % groups == 0, "groups must be >= 1 and divide w's ", rows,
              " rows, got ", groups);
  const int64_t n = rows / groups;
  TORCH_CHECK(groups == 1 || n % kGroup == 0, "grouped weights need N (rows per group) a multiple of ", kGroup,
              ", got ", n);
  TORCH_CHECK(x.size(1) == groups * k, "x must have groups*K = ", groups * k, " columns, got ", x.size(1));
  TORCH_CHECK(rows < (int64_t{1} << 31), "w must have fewer than 2^31 rows, got ", rows);
  const int64_t scale_rows = (rows + kGroup - 1) / kGroup;
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.dim() == 2 && w_scale.size(0) == scale_rows &&
                  w_scale.size(1) == k / kGroup && w_scale.stride(1) == 1 && w_scale.device() == x.device(),
              "w_scale must be an fp32 [", scale_rows, ", ", k / kGroup, "] tensor with unit last stride on ",
              x.device(), ", got ", w_scale.scalar_type(), " ", w_scale.sizes(), " strides ", w_scale.strides(),
              " on ", w_scale.device());
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.size(0) == m && out.size(1) == rows &&
                  out.stride(1) == 1 && out.device() == x.device(),
              "out must be a ", x.scalar_type(), " [", m, ", ", rows, "] tensor with unit column stride on ",
              x.device(), ", got ", out.scalar_type(), " ", out.sizes(), " strides ", out.strides(), " on ",
              out.device());

  Fp8GemvArgs args{};
  args.x = x.data_ptr();
  args.stride_x = x.stride(0);
  args.w = static_cast<const uint8_t*>(w.data_ptr());
  args.w_scale = w_scale.data_ptr<float>();
  args.stride_w_scale = w_scale.stride(0);
  args.out = out.data_ptr();
  args.stride_out = out.stride(0);
  args.m = static_cast<int>(m);
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(k);
  args.groups = static_cast<int>(groups);
  args.dtype = dtype;
  args.pow2_scales = pow2_scales;
  const char* error = launch_fp8_gemv(args, x.device().index(), reinterpret_cast<void*>(stream));
  TORCH_CHECK(error == nullptr, "fp8_gemv_cuda launch failed: ", error);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashdsa, m) {
  m.def("fp8_gemv_cuda(Tensor x, Tensor w, Tensor w_scale, int groups, bool pow2_scales, Tensor(a!) out, "
        "int stream) -> ()",
        &fp8_gemv);
}

}  // namespace flashdsa
