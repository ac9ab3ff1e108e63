"""Native Hopper kernels of the lightning indexer (CUDA C++; built on first use by
``flashdsa.runtime.native``, registered lazily by ``flashdsa.runtime.indexer``)."""
