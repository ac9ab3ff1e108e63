// torch.ops.flashdsa.indexer_logits_paged_cuda: checks the tensors, then launches paged_logits.cu's
// kernel. CUDA-free on purpose (the stream comes from Python), so it compiles against any torch build.

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "paged_logits.h"
#include "tensor_checks.h"

namespace flashdsa {

namespace {

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous(), name,
              " must be a contiguous ", dtype, " tensor of ", dim, " dims on ", like.device(), ", got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// q: [B, n, H, 128] e4m3 (as uint8 or float8); weights: [B * n, H] fp32; cache: [num_blocks, 64, 1,
// 132] uint8; context_lens: [B] int32; block_tables: [B, max_blocks] int32 (unit column stride);
// out: [B * n, max_context_len] fp32.
void indexer_logits_paged(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                          const at::Tensor& context_lens, const at::Tensor& block_tables, int64_t max_context_len,
                          bool fill_past_context, int64_t blocks_per_cta, at::Tensor& out, int64_t stream) {
  TORCH_CHECK(q.is_cuda() && q.element_size() == 1 && q.dim() == 4 && q.size(3) == 128 && q.is_contiguous(),
              "q must be a contiguous CUDA [B, n, H, 128] tensor of e4m3 bytes, got ", q.scalar_type(), " ", q.sizes());
  const int64_t batch = q.size(0), n = q.size(1), heads = q.size(2);
  check_tensor(weights, "weights", at::kFloat, {batch * n, heads}, q);
  check(cache, "cache", at::kByte, 4, q);
  TORCH_CHECK(cache.size(1) == 64 && cache.size(2) == 1 && cache.size(3) == 132,
              "cache must be [num_blocks, 64, 1, 132], got ", cache.sizes());
  check(context_lens, "context_lens", at::kInt, 1, q);
  TORCH_CHECK(context_lens.size(0) == batch, "context_lens must have ", batch, " entries, got ", context_lens.size(0));
  TORCH_CHECK(block_tables.device() == q.device() && block_tables.scalar_type() == at::kInt &&
                  block_tables.dim() == 2 && block_tables.size(0) == batch && block_tables.stride(1) == 1,
              "block_tables must be an int32 [", batch, ", max_blocks] tensor with unit column stride, got ",
              block_tables.scalar_type(), " ", block_tables.sizes());
  check_tensor(out, "out", at::kFloat, {batch * n, max_context_len}, q);
  TORCH_CHECK(n >= 1 && heads >= 1 && paged_logits_columns(static_cast<int>(n), static_cast<int>(heads)) > 0,
              "n queries x ", heads, " heads do not fit one wgmma (n <= 4 with H <= 64, n <= 2 with H <= 128, ",
              "H <= 256)");
  TORCH_CHECK(blocks_per_cta >= 1 && blocks_per_cta <= paged_logits_max_blocks_per_cta(), "blocks_per_cta must be ",
              "in [1, ", paged_logits_max_blocks_per_cta(), "], got ", blocks_per_cta);
  TORCH_CHECK(batch <= 65535, "batch must be at most 65535, got ", batch);
  check_aligned(q, "q");
  check_aligned(cache, "cache");
  PagedLogitsArgs args{static_cast<const uint8_t*>(q.data_ptr()), weights.data_ptr<float>(),
                       cache.data_ptr<uint8_t>(), context_lens.data_ptr<int>(), block_tables.data_ptr<int>(),
                       out.data_ptr<float>(), block_tables.stride(0), max_context_len, cache.size(0),
                       static_cast<int>(batch), static_cast<int>(n), static_cast<int>(heads),
                       static_cast<int>(blocks_per_cta), fill_past_context};
  const char* error = launch_paged_logits(args, q.device().index(), reinterpret_cast<void*>(stream));
  TORCH_CHECK(error == nullptr, "indexer_logits_paged_cuda launch failed: ", error);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashdsa, m) {
  m.def("indexer_logits_paged_cuda(Tensor q, Tensor weights, Tensor cache, Tensor context_lens, Tensor block_tables, "
        "int max_context_len, bool fill_past_context, int blocks_per_cta, Tensor(a!) out, int stream) -> ()",
        &indexer_logits_paged);
}

}  // namespace flashdsa
