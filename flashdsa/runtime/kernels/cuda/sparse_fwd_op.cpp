// torch.ops.flashdsa.sparse_fwd_cuda: checks every tensor and number, then launches
// sparse_attention.cu's kernel over bf16 key rows (the forward: prefill, training). CUDA-free on
// purpose (the stream comes from Python), so it compiles against any torch build.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "op_checks.h"
#include "sparse_attention.h"

namespace flashdsa {
namespace {

constexpr int64_t kDv = 512;

bool supported_d_qk(int64_t d_qk) { return d_qk == 512 || d_qk == 576; }

// q: [s_q, h_q, d_qk] bf16 (d_qk 512 or 576); kv: [s_kv, 1, d_qk] bf16; indices: [s_q, 1, topk]
// int32 key rows; out: [s_q, h_q, 512] bf16; max_logits, lse: [s_q, h_q] fp32. One split: every
// query row's top-k list is one CTA's (per 64 heads).
void sparse_fwd(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices, double sm_scale, at::Tensor& out,
                at::Tensor& max_logits, at::Tensor& lse, int64_t stream) {
  check_queries(q, 3, supported_d_qk, "[s_q, h_q, d_qk 512 or 576]");
  const int64_t s_q = q.size(0), h_q = q.size(1), d_qk = q.size(2);
  TORCH_CHECK(kv.dim() == 3, "kv must be [s_kv, 1, d_qk=", d_qk, "], got ", kv.sizes());
  check_tensor(kv, "kv", at::kBFloat16, {kv.size(0), 1, d_qk}, q);
  if (kv.numel() > 0) check_aligned(kv, "kv");
  TORCH_CHECK(indices.dim() == 3, "indices must be [s_q=", s_q, ", 1, topk], got ", indices.sizes());
  check_topk(indices);
  const int64_t topk = indices.size(2);
  check_tensor(indices, "indices", at::kInt, {s_q, 1, topk}, q);
  TORCH_CHECK(std::isfinite(sm_scale) && sm_scale > 0, "sm_scale must be a positive finite number, got ", sm_scale);
  check_tensor(out, "out", at::kBFloat16, {s_q, h_q, kDv}, q);
  check_tensor(max_logits, "max_logits", at::kFloat, {s_q, h_q}, q);
  check_tensor(lse, "lse", at::kFloat, {s_q, h_q}, q);
  SparseAttentionArgs args{};
  args.q = q.data_ptr();
  args.keys = kv.data_ptr();
  args.format = KeyFormat::kBf16;
  args.d_qk = static_cast<int>(d_qk);
  args.num_keys = kv.size(0);
  args.indices = indices.data_ptr<int32_t>();
  args.rows = s_q;
  args.s_q = 1;  // lse [s_q, h_q] is the decode's [b, h_q, s_q] with b = s_q rows of one query each
  args.h_q = static_cast<int>(h_q);
  args.topk = static_cast<int>(topk);
  args.splits = 1;
  args.tokens_per_split = static_cast<int>((topk + kSparseKeysPerTile - 1) / kSparseKeysPerTile * kSparseKeysPerTile);
  args.scale_log2 = static_cast<float>(sm_scale * 1.4426950408889634);
  args.out = out.data_ptr();
  args.lse = lse.data_ptr<float>();
  args.max_logits = max_logits.data_ptr<float>();
  const char* error = launch_sparse_attention(args, q.device().index(), reinterpret_cast<void*>(stream));
  TORCH_CHECK(error == nullptr, "sparse_fwd_cuda launch failed: ", error);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashdsa, m) {
  m.def("sparse_fwd_cuda(Tensor q, Tensor kv, Tensor indices, float sm_scale, Tensor(a!) out, "
        "Tensor(b!) max_logits, Tensor(c!) lse, int stream) -> ()",
        &sparse_fwd);
}

}  // namespace flashdsa
