// torch.ops.flashdsa.sparse_bwd_dq_cuda and sparse_bwd_dkv_cuda: check every tensor and number,
// then launch the native backward's dq kernel (sparse_bwd_dq.cu) or dkv kernels (sparse_bwd_dkv.cu)
// for one chunk of query tokens. CUDA-free on purpose (the stream comes from Python), so they compile
// against any torch build.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <utility>

#include "op_checks.h"
#include "sparse_bwd.h"

namespace flashdsa {
namespace {

constexpr int64_t kDv = 512;

bool supported_d_qk(int64_t d_qk) { return d_qk == 512 || d_qk == 576; }

// A flat bf16 scratch buffer holding at least `need` values, 16-byte aligned.
void check_scratch(const at::Tensor& t, const char* name, int64_t need, const at::Tensor& q) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device() == q.device() && t.scalar_type() == at::kBFloat16 && t.dim() == 1 && t.numel() >= need,
              name, " must be a 1-D bf16 tensor of at least ", need, " values on ", q.device(), ", got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
  check_aligned(t, name);
}

// The chunk [token0, token0 + tokens) of s_q query tokens and topk a positive multiple of `tile`.
void check_chunk(int64_t s_q, int64_t topk, int64_t tile, int64_t token0, int64_t tokens) {
  TORCH_CHECK(topk >= tile && topk % tile == 0 && topk <= INT32_MAX, "indices must have topk a positive multiple of ",
              tile, ", got ", topk);
  TORCH_CHECK(token0 >= 0 && tokens >= 0 && token0 + tokens <= s_q, "token0 and tokens must cut [0, s_q=", s_q,
              "), got token0=", token0, ", tokens=", tokens);
}

// q, kv ([s_kv, d_qk] bf16 rows), out, dout, lse ([s_q, h_q] fp32), indices ([s_q, topk] int32, topk a
// multiple of 32); dq: like q, written for the chunk's tokens; p, ds: bf16 scratch of the chunk
// ([tokens, h_q, topk] at their start), written.
void sparse_bwd_dq(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& out, const at::Tensor& dout,
                   const at::Tensor& lse, const at::Tensor& indices, at::Tensor& dq, at::Tensor& p, at::Tensor& ds,
                   int64_t token0, int64_t tokens, double sm_scale, int64_t stream) {
  check_queries(q, 3, supported_d_qk, "[s_q, h_q, d_qk 512 or 576]");
  const int64_t s_q = q.size(0), h_q = q.size(1), d_qk = q.size(2);
  TORCH_CHECK(kv.dim() == 2, "kv must be [s_kv, d_qk=", d_qk, "], got ", kv.sizes());
  check_tensor(kv, "kv", at::kBFloat16, {kv.size(0), d_qk}, q);
  if (kv.numel() > 0) check_aligned(kv, "kv");
  for (const auto& [t, name] : {std::pair{&out, "out"}, std::pair{&dout, "dout"}}) {
    check_tensor(*t, name, at::kBFloat16, {s_q, h_q, kDv}, q);
    check_aligned(*t, name);
  }
  check_tensor(lse, "lse", at::kFloat, {s_q, h_q}, q);
  TORCH_CHECK(indices.dim() == 2, "indices must be [s_q=", s_q, ", topk], got ", indices.sizes());
  const int64_t topk = indices.size(1);
  check_tensor(indices, "indices", at::kInt, {s_q, topk}, q);
  check_aligned(indices, "indices");  // the kernel reads two ids at a time
  check_chunk(s_q, topk, kSparseBwdDqKeysPerTile, token0, tokens);
  check_tensor(dq, "dq", at::kBFloat16, {s_q, h_q, d_qk}, q);
  check_aligned(dq, "dq");
  check_scratch(p, "p", tokens * h_q * topk, q);
  check_scratch(ds, "ds", tokens * h_q * topk, q);
  TORCH_CHECK(std::isfinite(sm_scale) && sm_scale > 0, "sm_scale must be a positive finite number, got ", sm_scale);
  SparseBwdDqArgs args{};
  args.q = q.data_ptr();
  args.kv = kv.data_ptr();
  args.out = out.data_ptr();
  args.dout = dout.data_ptr();
  args.lse = lse.data_ptr<float>();
  args.indices = indices.data_ptr<int32_t>();
  args.dq = dq.data_ptr();
  args.p = p.data_ptr();
  args.ds = ds.data_ptr();
  args.s_kv = kv.size(0);
  args.token0 = token0;
  args.tokens = tokens;
  args.h_q = static_cast<int>(h_q);
  args.d_qk = static_cast<int>(d_qk);
  args.topk = static_cast<int>(topk);
  args.sm_scale = static_cast<float>(sm_scale);
  const char* error = launch_sparse_bwd_dq(args, q.device().index(), reinterpret_cast<void*>(stream));
  TORCH_CHECK(error == nullptr, "sparse_bwd_dq_cuda launch failed: ", error);
}

// q: [s_q, h_q, d_qk] bf16; dout: [s_q, h_q, 512] bf16; indices: [s_q, topk] int32 (topk a multiple of
// 64); p, ds: the dq kernel's scratch of tokens [token0, token0 + tokens), [tokens, h_q, topk] bf16
// at their start; dkv: fp32 [s_kv, d_qk] (added to) or, deterministic, [>= tokens * topk, d_qk] rows.
void sparse_bwd_dkv(const at::Tensor& q, const at::Tensor& dout, const at::Tensor& indices, const at::Tensor& p,
                    const at::Tensor& ds, at::Tensor& dkv, int64_t token0, int64_t tokens, bool deterministic,
                    int64_t stream) {
  check_queries(q, 3, supported_d_qk, "[s_q, h_q, d_qk 512 or 576]");
  const int64_t s_q = q.size(0), h_q = q.size(1), d_qk = q.size(2);
  check_tensor(dout, "dout", at::kBFloat16, {s_q, h_q, kDv}, q);
  check_aligned(dout, "dout");
  TORCH_CHECK(indices.dim() == 2, "indices must be [s_q=", s_q, ", topk], got ", indices.sizes());
  const int64_t topk = indices.size(1);
  check_tensor(indices, "indices", at::kInt, {s_q, topk}, q);
  check_chunk(s_q, topk, kSparseBwdSlotsPerTile, token0, tokens);
  check_scratch(p, "p", tokens * h_q * topk, q);
  check_scratch(ds, "ds", tokens * h_q * topk, q);
  TORCH_CHECK(dkv.device() == q.device() && dkv.scalar_type() == at::kFloat && dkv.dim() == 2 &&
                  dkv.size(1) == d_qk && dkv.is_contiguous() &&
                  (!deterministic || (dkv.size(0) >= tokens * topk && tokens * topk <= INT32_MAX)),
              "dkv must be a contiguous float32 [", deterministic ? "tokens * topk (below 2^31) or more" : "s_kv",
              ", d_qk=", d_qk, "] tensor on ", q.device(), ", got ", dkv.scalar_type(), " ", dkv.sizes(), " on ",
              dkv.device());
  if (dkv.numel() > 0) check_aligned(dkv, "dkv");
  SparseBwdDkvArgs args{};
  args.q = q.data_ptr();
  args.dout = dout.data_ptr();
  args.p = p.data_ptr();
  args.ds = ds.data_ptr();
  args.indices = indices.data_ptr<int32_t>();
  args.dkv = dkv.data_ptr<float>();
  args.s_kv = deterministic ? 0 : dkv.size(0);
  args.token0 = token0;
  args.tokens = tokens;
  args.h_q = static_cast<int>(h_q);
  args.d_qk = static_cast<int>(d_qk);
  args.topk = static_cast<int>(topk);
  args.deterministic = deterministic;
  const char* error = launch_sparse_bwd_dkv(args, q.device().index(), reinterpret_cast<void*>(stream));
  TORCH_CHECK(error == nullptr, "sparse_bwd_dkv_cuda launch failed: ", error);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashdsa, m) {
  m.def("sparse_bwd_dq_cuda(Tensor q, Tensor kv, Tensor out, Tensor dout, Tensor lse, Tensor indices, Tensor(a!) dq, "
        "Tensor(b!) p, Tensor(c!) ds, int token0, int tokens, float sm_scale, int stream) -> ()",
        &sparse_bwd_dq);
  m.def("sparse_bwd_dkv_cuda(Tensor q, Tensor dout, Tensor indices, Tensor p, Tensor ds, Tensor(a!) dkv, "
        "int token0, int tokens, bool deterministic, int stream) -> ()",
        &sparse_bwd_dkv);
}

}  // namespace flashdsa
