"""Triton MoE kernels (registered lazily by ``flashdsa.runtime.moe``)."""
