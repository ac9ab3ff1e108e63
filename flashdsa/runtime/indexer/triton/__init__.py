"""Triton kernels of the lightning indexer (registered lazily by ``flashdsa.runtime.indexer``)."""
