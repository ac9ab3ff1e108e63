// Host helper for kernels that need more than 48 KB of dynamic shared memory (flashdsa.runtime.native
// puts this folder on every native extension's include path).
#pragma once

#include <atomic>
#include <cstdint>
#include <cuda_runtime.h>

namespace flashdsa {

// Raises the dynamic shared-memory limit of `kernel` to `bytes` on `device` (the current device)
// the first time it is asked there, not on every launch: the driver call costs microseconds of host
// time. `bytes` is the kernel's one fixed size. Returns the CUDA error.
template <auto kernel>
cudaError_t opt_in_shared_memory(int bytes, int device) {
  static std::atomic<uint64_t> opted_in{0};  // bit d: device d (devices from 64 on ask every time)
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (opted_in.load(std::memory_order_relaxed) & bit) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) opted_in.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

}  // namespace flashdsa
