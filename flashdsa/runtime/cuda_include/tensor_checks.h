// Host-side tensor checks shared by the native ops' torch bindings (*_op.cpp): each failure is a
// TORCH_CHECK (a Python RuntimeError) that names the argument.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace flashdsa {

inline void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must start on a 16-byte boundary (the kernel reads it with 16-byte loads), got address ",
              t.data_ptr());
}

// t is a contiguous `dtype` tensor of `shape` on q's device.
inline void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
                         const at::Tensor& q) {
  TORCH_CHECK(t.device() == q.device() && t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous(), name,
              " must be a contiguous ", dtype, " tensor of shape ", shape, " on ", q.device(), ", got ",
              t.scalar_type(), " ", t.sizes(), (t.is_contiguous() ? "" : " (not contiguous)"), " on ", t.device());
}

}  // namespace flashdsa
