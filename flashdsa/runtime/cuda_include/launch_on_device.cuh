// Host helper of the native ops' launchers: a launch with the op's device current.
#pragma once

#include <cuda_runtime.h>

namespace flashdsa {

// Makes `device` current, calls launch() (which returns a cudaError_t), gives the caller's device
// back; returns nullptr or the CUDA error's text.
template <typename Launch>
const char* launch_on_device(int device, Launch&& launch) {
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  err = launch();
  if (previous != device) cudaSetDevice(previous);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace flashdsa
