// torch.ops.flashdsa.fp4_moe_gate_up_cuda / fp4_moe_down_cuda: check the tensors, then launch
// fp4_moe.cu's kernel. CUDA-free on purpose (the stream comes from Python), so it compiles against
// any torch build.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "fp4_moe.h"

namespace flashdsa {

namespace {

constexpr int64_t kGroup = 32;  // inputs per weight scale

// A tensor of dtype and shape on `like`'s device whose rows start on 16-byte boundaries (unit last stride).
void check(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
           const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == dtype && t.sizes() == shape && t.stride(-1) == 1,
              name, " must be a ", dtype, " tensor of shape ", shape, " with unit last stride on ", like.device(),
              ", got ", t.scalar_type(), " ", t.sizes(), " strides ", t.strides(), " on ", t.device());
  const int64_t row_bytes = t.dim() > 1 ? t.stride(-2) * t.element_size() : 0;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && row_bytes % 16 == 0, name,
              " must start on a 16-byte boundary with rows a multiple of 16 bytes apart (16-byte loads), got address ",
              t.data_ptr(), " and strides ", t.strides());
}

// An fp32 scale tensor of shape on `like`'s device with unit last stride (read a float at a time)
// (the kernel indexes it with 32-bit offsets).
void check_scale(const at::Tensor& t, const char* name, at::IntArrayRef shape, const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == at::kFloat && t.sizes() == shape && t.stride(-1) == 1,
              name, " must be an fp32 tensor of shape ", shape, " with unit last stride on ", like.device(), ", got ",
              t.scalar_type(), " ", t.sizes(), " strides ", t.strides(), " on ", t.device());
  TORCH_CHECK(t.size(0) * t.stride(0) < (int64_t{1} << 31), name, " must span fewer than 2^31 elements, got ",
              t.sizes(), " strides ", t.strides());
}

// The expert weights and their scales: w [E, N, K/2] uint8, w_scale [E, N, K/32] uint8.
void check_weights(const at::Tensor& w, const at::Tensor& w_scale, int64_t n, int64_t k, const at::Tensor& like) {
  TORCH_CHECK(w.dim() == 3, "w must be [E, N, K/2], got ", w.sizes());
  check(w, "w", at::kByte, {w.size(0), n, k / 2}, like);
  TORCH_CHECK(w_scale.dim() == 3 && w_scale.stride(-1) == 1 && w_scale.scalar_type() == at::kByte &&
                  w_scale.sizes() == at::IntArrayRef({w.size(0), n, k / kGroup}) && w_scale.device() == like.device() &&
                  reinterpret_cast<uintptr_t>(w_scale.data_ptr()) % 4 == 0 && w_scale.stride(1) % 4 == 0,
              "w_scale must be a uint8 [", w.size(0), ", ", n, ", ", k / kGroup,
              "] tensor with 4-byte aligned rows on ", like.device(), ", got ", w_scale.scalar_type(), " ",
              w_scale.sizes(), " strides ", w_scale.strides());
  TORCH_CHECK(k % kFp4MoeChunk == 0, "K must be a multiple of ", kFp4MoeChunk, ", got ", k);
}

void check_aligned(const at::Tensor& sorted_pairs, const at::Tensor& block_experts, const at::Tensor& like) {
  TORCH_CHECK(block_experts.dim() == 1, "block_experts must be [blocks], got ", block_experts.sizes());
  check(block_experts, "block_experts", at::kInt, {block_experts.size(0)}, like);
  check(sorted_pairs, "sorted_pairs", at::kInt, {block_experts.size(0) * kFp4MoeBlockM}, like);
}

// The arguments both GEMMs share: activations, weights and the aligned blocks.
Fp4MoeArgs common_args(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& sorted_pairs, const at::Tensor& block_experts, int64_t n, int64_t inter,
                       int64_t top_k) {
  Fp4MoeArgs args{};
  args.a = a.data_ptr<uint8_t>();
  args.a_scale = a_scale.data_ptr<float>();
  args.stride_a = a.stride(0);
  args.stride_a_scale = a_scale.stride(0);
  args.w = w.data_ptr<uint8_t>();
  args.w_scale = w_scale.data_ptr<uint8_t>();
  args.stride_w_expert = w.stride(0);
  args.stride_w_row = w.stride(1);
  args.stride_s_expert = w_scale.stride(0);
  args.stride_s_row = w_scale.stride(1);
  args.sorted_pairs = sorted_pairs.data_ptr<int>();
  args.block_experts = block_experts.data_ptr<int>();
  args.blocks = static_cast<int>(block_experts.size(0));
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(a.size(1));
  args.inter = static_cast<int>(inter);
  args.top_k = static_cast<int>(top_k);
  return args;
}

void launch(const Fp4MoeArgs& args, bool gated, int64_t stream) {
  const char* error = launch_fp4_moe(args, gated, reinterpret_cast<void*>(stream));
  TORCH_CHECK(error == nullptr, "fp4_moe launch failed: ", error);
}

// a: [T, H] e4m3 (as uint8) with a_scale [T, H/128] fp32; w13 [E, 2I, H/2]; h: [blocks*16, I] uint8
// (e4m3) and h_scale [blocks*16, I/32] fp32 written for the blocks' pairs; limit <= 0: no clip.
void gate_up(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& w13, const at::Tensor& w13_scale,
             const at::Tensor& sorted_pairs, const at::Tensor& block_experts, int64_t top_k, double limit,
             at::Tensor& h, at::Tensor& h_scale, int64_t stream) {
  TORCH_CHECK(a.is_cuda() && a.dim() == 2, "a must be a CUDA [T, H] tensor, got ", a.sizes(), " on ", a.device());
  const int64_t tokens = a.size(0), hidden = a.size(1);
  check(a, "a", at::kByte, {tokens, hidden}, a);
  TORCH_CHECK(hidden % kFp4MoeChunk == 0, "H must be a multiple of ", kFp4MoeChunk, ", got ", hidden);
  check_scale(a_scale, "a_scale", {tokens, hidden / 128}, a);
  TORCH_CHECK(w13.dim() == 3 && w13.size(1) % 2 == 0, "w13 must be [E, 2I, H/2], got ", w13.sizes());
  const int64_t inter = w13.size(1) / 2;
  TORCH_CHECK(inter % kFp4MoeGateUpColumns == 0, "I must be a multiple of ", kFp4MoeGateUpColumns, ", got ",
              inter);
  check_weights(w13, w13_scale, 2 * inter, hidden, a);
  check_aligned(sorted_pairs, block_experts, a);
  TORCH_CHECK(top_k >= 1, "top_k must be >= 1, got ", top_k);
  const int64_t rows = sorted_pairs.size(0);
  check(h, "h", at::kByte, {rows, inter}, a);
  check_scale(h_scale, "h_scale", {rows, inter / kGroup}, a);
  Fp4MoeArgs args = common_args(a, a_scale, w13, w13_scale, sorted_pairs, block_experts, inter, inter, top_k);
  args.limit = static_cast<float>(limit);
  args.h = h.data_ptr<uint8_t>();
  args.h_scale = h_scale.data_ptr<float>();
  args.stride_h = h.stride(0);
  args.stride_h_scale = h_scale.stride(0);
  launch(args, true, stream);
}

// h: [blocks*16, I] e4m3 (as uint8) with h_scale [blocks*16, I/32] fp32; w2 [E, H, I/2];
// route_weights [pairs] fp32; out [pairs, H] bf16 written at the blocks' pairs.
void down(const at::Tensor& h, const at::Tensor& h_scale, const at::Tensor& w2, const at::Tensor& w2_scale,
          const at::Tensor& sorted_pairs, const at::Tensor& block_experts, const at::Tensor& route_weights,
          at::Tensor& out, int64_t stream) {
  TORCH_CHECK(h.is_cuda() && h.dim() == 2, "h must be a CUDA [rows, I] tensor, got ", h.sizes(), " on ", h.device());
  const int64_t rows = h.size(0), inter = h.size(1);
  check(h, "h", at::kByte, {rows, inter}, h);
  TORCH_CHECK(inter % kFp4MoeChunk == 0, "I must be a multiple of ", kFp4MoeChunk, ", got ", inter);
  check_scale(h_scale, "h_scale", {rows, inter / kGroup}, h);
  TORCH_CHECK(w2.dim() == 3, "w2 must be [E, H, I/2], got ", w2.sizes());
  const int64_t hidden = w2.size(1);
  TORCH_CHECK(hidden % kFp4MoeDownColumns == 0, "H must be a multiple of ", kFp4MoeDownColumns,
              ", got ", hidden);
  check_weights(w2, w2_scale, hidden, inter, h);
  check_aligned(sorted_pairs, block_experts, h);
  TORCH_CHECK(rows == sorted_pairs.size(0), "h must have one row per aligned row (", sorted_pairs.size(0), "), got ",
              rows);
  TORCH_CHECK(route_weights.dim() == 1 && route_weights.scalar_type() == at::kFloat && route_weights.is_contiguous() &&
                  route_weights.device() == h.device(),
              "route_weights must be a contiguous fp32 [pairs] tensor, got ", route_weights.scalar_type(), " ",
              route_weights.sizes());
  check(out, "out", at::kBFloat16, {route_weights.size(0), hidden}, h);
  Fp4MoeArgs args = common_args(h, h_scale, w2, w2_scale, sorted_pairs, block_experts, hidden, inter, 1);
  args.out = out.data_ptr();
  args.stride_out = out.stride(0);
  args.route_weights = route_weights.data_ptr<float>();
  launch(args, false, stream);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashdsa, m) {
  m.def("fp4_moe_gate_up_cuda(Tensor a, Tensor a_scale, Tensor w13, Tensor w13_scale, Tensor sorted_pairs, "
        "Tensor block_experts, int top_k, float limit, Tensor(a!) h, Tensor(b!) h_scale, int stream) -> ()",
        &gate_up);
  m.def("fp4_moe_down_cuda(Tensor h, Tensor h_scale, Tensor w2, Tensor w2_scale, Tensor sorted_pairs, "
        "Tensor block_experts, Tensor route_weights, Tensor(a!) out, int stream) -> ()",
        &down);
}

}  // namespace flashdsa
