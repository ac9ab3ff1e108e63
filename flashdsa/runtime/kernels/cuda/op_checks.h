// Tensor checks shared by the sparse attention ops (sparse_decode_op.cpp, sparse_fwd_op.cpp): each
// failure is a TORCH_CHECK (a Python RuntimeError) that names the argument. The generic ones are in
// cuda_include/tensor_checks.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "sparse_attention.h"
#include "tensor_checks.h"

namespace flashdsa {

// q: a contiguous CUDA bf16 tensor of `dims` dims, the last `d_qk` wide, with h_q (dim -2) 64 or 128.
inline void check_queries(const at::Tensor& q, int64_t dims, bool (*d_qk_ok)(int64_t), const char* shape) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == dims && d_qk_ok(q.size(-1)) &&
                  q.is_contiguous(),
              "q must be a contiguous CUDA bf16 tensor ", shape, ", got ", q.scalar_type(), " ", q.sizes(),
              (q.is_contiguous() ? "" : " (not contiguous)"), " on ", q.device());
  const int64_t h_q = q.size(-2);
  TORCH_CHECK(h_q > 0 && h_q % kSparseHeadsPerCta == 0 && h_q <= 2 * kSparseHeadsPerCta,
              "q must have h_q 64 or 128 (64 heads per CTA), got ", h_q);
  TORCH_CHECK(q.numel() / q.size(-1) <= INT32_MAX, "q must have fewer than 2^31 query rows x heads, got ",
              q.sizes());
  check_aligned(q, "q");
}

inline void check_topk(const at::Tensor& indices) {
  const int64_t topk = indices.size(-1);
  TORCH_CHECK(topk >= 1 && topk <= kSparseMaxTopk, "indices must have topk in [1, ", kSparseMaxTopk, "], got ", topk);
}

}  // namespace flashdsa
