"""FP8 block-scaled linear at decode sizes (1 to 4 tokens) through the native kernel of ``gemv.cu``.

One launch quantizes the activations (per token and 128 channels, the bytes and scales of
``runtime.gemm.quantize_activations``) and multiplies them with the e4m3 weight, summing in fp32,
with no split-K workspace to sum or reset (``gemv.cu`` says how). Grouped weights (V4's output
projection: group g's inputs through weight rows ``[g*N, (g+1)*N)``) are one launch too.
The call reads no device value back and needs no workspace, so it can be captured in a CUDA
graph. Importing this module builds the extension once (``flashdsa.runtime.native``); a failed
build raises ImportError, so dispatch can fall back and say why.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import native
from flashdsa.runtime.gemm.cuda import MAX_K, MAX_M, supports

__all__ = ["MAX_K", "MAX_M", "fp8_gemv", "fp8_linear", "supports"]

native.load("gemm")


def fp8_gemv(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, groups: int,
             pow2_scales: bool) -> torch.Tensor:
    """``x: [M, groups*K]`` bf16/fp16/fp32 (unit column stride, any row stride, M in 1..4) through
    ``w_fp8: [groups*N, K]`` e4m3 (contiguous, K a multiple of 128, N a multiple of 128 when
    groups > 1) with ``w_scale: [ceil(groups*N/128), K/128]`` fp32 -> ``[M, groups*N]`` in x's dtype:
    ``y[m, g*N + j] = sum_k xq[m, g*K + k] * w[g*N + j, k]`` with x quantized to e4m3 per token and
    128 channels (power-of-two scales with ``pow2_scales``) and both operands dequantized by their
    block scales, summed in fp32. The op checks every argument (RuntimeError naming it)."""
    out = torch.empty(x.shape[0], w_fp8.shape[0], dtype=x.dtype, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    torch.ops.flashdsa.fp8_gemv_cuda(x, w_fp8, w_scale, groups, pow2_scales, out, stream)
    return out


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, groups: int, pow2_scales: bool,
               backend: Optional[str]) -> torch.Tensor:
    """The ``cuda`` backend of ``runtime.gemm.fp8_linear`` (arguments checked there): :func:`fp8_gemv`
    where it takes the call, else (a forced backend) the composed path with automatic choices."""
    k = x.shape[1] // groups
    if x.stride(1) == 1 and supports(x.shape[0], w_fp8.shape[0], k, groups,
                                     torch.cuda.get_device_capability(x.device)) is None:
        return fp8_gemv(x, w_fp8, w_scale, groups, pow2_scales)
    from flashdsa.runtime.gemm import composed_linear

    return composed_linear(x, w_fp8, w_scale, groups, pow2_scales, None if backend == "cuda" else backend)
