"""Triton kernels of the FP8 block-scaled GEMM (registered lazily by ``flashdsa.runtime.gemm``):
``quantize.quantize_activations`` and ``gemm.fp8_gemm``, whose launch shape ``configs`` picks."""
