// torch.ops.flashdsa.sparse_decode_cuda: checks every tensor and number, then launches
// sparse_attention.cu's kernels over the FP8 cache. CUDA-free on purpose (the stream comes from
// Python), so it compiles against any torch build.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "op_checks.h"
#include "sparse_attention.h"

namespace flashdsa {
namespace {

constexpr int64_t kDqk = 576;
constexpr int64_t kDv = 512;
constexpr int64_t kTokenBytes = 656;

// q: [b, s_q, h_q, 576] bf16; kv_cache: [num_blocks, block_size, 1, 656] uint8; indices: [b, s_q, topk]
// int32 slot ids; out: [b, s_q, h_q, 512] bf16; lse: [b, h_q, s_q] fp32. With num_splits > 1,
// part_out: [b * s_q, num_splits, h_q, 512] fp32 and part_lse: [b * s_q, num_splits, h_q] fp32
// (workspace; ignored for one split). The top-k list is cut into num_splits parts of
// tokens_per_split (a multiple of 64) positions.
void sparse_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& indices, double sm_scale,
                   int64_t num_splits, int64_t tokens_per_split, at::Tensor& out, at::Tensor& lse,
                   at::Tensor& part_out, at::Tensor& part_lse, int64_t stream) {
  check_queries(q, 4, [](int64_t d) { return d == kDqk; }, "[b, s_q, h_q, 576]");
  const int64_t b = q.size(0), s_q = q.size(1), h_q = q.size(2), rows = b * s_q;
  TORCH_CHECK(kv_cache.device() == q.device() && kv_cache.scalar_type() == at::kByte && kv_cache.dim() == 4 &&
                  kv_cache.size(2) == 1 && kv_cache.size(3) == kTokenBytes && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous uint8 tensor [num_blocks, block_size, 1, ", kTokenBytes, "] on ",
              q.device(), ", got ", kv_cache.scalar_type(), " ", kv_cache.sizes(), " on ", kv_cache.device());
  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(1);
  if (num_slots > 0) check_aligned(kv_cache, "kv_cache");
  TORCH_CHECK(indices.dim() == 3 && indices.size(0) == b && indices.size(1) == s_q,
              "indices must be [b=", b, ", s_q=", s_q, ", topk], got ", indices.sizes());
  check_topk(indices);
  const int64_t topk = indices.size(2);
  check_tensor(indices, "indices", at::kInt, {b, s_q, topk}, q);
  TORCH_CHECK(std::isfinite(sm_scale) && sm_scale > 0, "sm_scale must be a positive finite number, got ", sm_scale);
  TORCH_CHECK(num_splits >= 1 && num_splits <= kSparseMaxSplits, "num_splits must be in [1, ",
              kSparseMaxSplits, "], got ", num_splits);
  TORCH_CHECK(tokens_per_split > 0 && tokens_per_split % kSparseKeysPerTile == 0 &&
                  (num_splits - 1) * tokens_per_split < topk && num_splits * tokens_per_split >= topk,
              "tokens_per_split must be a positive multiple of ", kSparseKeysPerTile, " whose ", num_splits,
              " splits cover topk=", topk, " with none empty, got ", tokens_per_split);
  check_tensor(out, "out", at::kBFloat16, {b, s_q, h_q, kDv}, q);
  check_tensor(lse, "lse", at::kFloat, {b, h_q, s_q}, q);
  if (num_splits > 1) {
    check_tensor(part_out, "part_out", at::kFloat, {rows, num_splits, h_q, kDv}, q);
    check_tensor(part_lse, "part_lse", at::kFloat, {rows, num_splits, h_q}, q);
  }
  SparseAttentionArgs args{};
  args.q = q.data_ptr();
  args.keys = kv_cache.data_ptr();
  args.format = KeyFormat::kFp8Cache;
  args.d_qk = static_cast<int>(kDqk);
  args.num_keys = num_slots;
  args.indices = indices.data_ptr<int32_t>();
  args.rows = rows;
  args.s_q = static_cast<int>(s_q);
  args.h_q = static_cast<int>(h_q);
  args.topk = static_cast<int>(topk);
  args.splits = static_cast<int>(num_splits);
  args.tokens_per_split = static_cast<int>(tokens_per_split);
  args.scale_log2 = static_cast<float>(sm_scale * 1.4426950408889634);
  args.out = out.data_ptr();
  args.lse = lse.data_ptr<float>();
  args.part_out = num_splits > 1 ? part_out.data_ptr<float>() : nullptr;
  args.part_lse = num_splits > 1 ? part_lse.data_ptr<float>() : nullptr;
  const char* error = launch_sparse_attention(args, q.device().index(), reinterpret_cast<void*>(stream));
  TORCH_CHECK(error == nullptr, "sparse_decode_cuda launch failed: ", error);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashdsa, m) {
  m.def("sparse_decode_cuda(Tensor q, Tensor kv_cache, Tensor indices, float sm_scale, int num_splits, "
        "int tokens_per_split, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) part_out, Tensor(d!) part_lse, "
        "int stream) -> ()",
        &sparse_decode);
}

}  // namespace flashdsa
