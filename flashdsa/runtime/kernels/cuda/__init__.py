"""Native Hopper kernels of sparse MLA attention (CUDA C++; built on first use by
``flashdsa.runtime.native``, registered lazily by ``flashdsa.runtime.kernels``)."""
