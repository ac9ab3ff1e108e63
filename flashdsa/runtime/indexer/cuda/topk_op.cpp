// torch.ops.flashdsa.indexer_topk_cuda: checks the tensors, then launches topk.cu's kernel.
// CUDA-free on purpose (the stream comes from Python), so it compiles against any torch build.

#include <optional>

#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace flashdsa {

int indexer_topk_max_topk();
const char* launch_indexer_topk(const float* logits, int64_t stride, int64_t rows, int64_t width, const int* starts,
                                const int* ends, int64_t topk, bool sorted, int* out, int64_t out_stride, int device,
                                void* stream);

namespace {

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows, const at::Tensor& logits) {
  TORCH_CHECK(t.device() == logits.device() && t.scalar_type() == dtype && t.dim() >= 1 && t.size(0) == rows &&
                  t.stride(-1) == 1,
              name, " must be a ", dtype, " tensor of ", rows, " rows on ", logits.device(), ", unit stride, got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// logits: [T, L] fp32 (unit column stride); starts, ends: [T] int32, or both absent (whole rows);
// out: [T, topk] int32.
void indexer_topk(const at::Tensor& logits, const std::optional<at::Tensor>& starts,
                  const std::optional<at::Tensor>& ends, int64_t topk, bool sorted, at::Tensor& out, int64_t stream) {
  TORCH_CHECK(logits.is_cuda() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be a CUDA fp32 [T, L] tensor with unit column stride, got ", logits.scalar_type(), " ",
              logits.sizes(), " strides ", logits.strides(), " on ", logits.device());
  const int64_t rows = logits.size(0), width = logits.size(1);
  TORCH_CHECK(topk >= 1 && topk <= indexer_topk_max_topk(), "topk must be in [1, ", indexer_topk_max_topk(),
              "], got ", topk);
  TORCH_CHECK(width < (int64_t{1} << 31) - (int64_t{1} << 16), "logits rows must be shorter than 2^31 - 2^16, got ",
              width);
  TORCH_CHECK(starts.has_value() == ends.has_value(), "starts and ends must be given together");
  if (starts.has_value()) {
    check_rows(*starts, "starts", at::kInt, rows, logits);
    check_rows(*ends, "ends", at::kInt, rows, logits);
  }
  check_rows(out, "out", at::kInt, rows, logits);
  TORCH_CHECK(out.dim() == 2 && out.size(1) == topk, "out must be [", rows, ", ", topk, "], got ", out.sizes());
  const char* error = launch_indexer_topk(logits.data_ptr<float>(), logits.stride(0), rows, width,
                                          starts ? starts->data_ptr<int>() : nullptr,
                                          ends ? ends->data_ptr<int>() : nullptr, topk, sorted,
                                          out.data_ptr<int>(), out.stride(0), logits.device().index(),
                                          reinterpret_cast<void*>(stream));
  TORCH_CHECK(error == nullptr, "indexer_topk_cuda launch failed: ", error);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashdsa, m) {
  m.def("indexer_topk_cuda(Tensor logits, Tensor? starts, Tensor? ends, int topk, bool sorted, Tensor(a!) out, "
        "int stream) -> ()",
        &indexer_topk);
}

}  // namespace flashdsa
