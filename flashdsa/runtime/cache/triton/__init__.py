"""Triton cache-write kernels (registered lazily by ``flashdsa.runtime.cache``)."""
