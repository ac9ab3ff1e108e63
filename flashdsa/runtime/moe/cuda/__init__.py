"""Native Hopper kernels of the routed experts (CUDA C++; built on first use by
``flashdsa.runtime.native``, registered lazily by ``flashdsa.runtime.moe``)."""
