"""RMSNorm, optionally fused with the residual add before it: public function, checks, dispatch.

``rms_norm(x, weight, eps, residual)`` computes, row by row, ``h = x + residual`` (when given,
rounded to x's dtype) and ``y = weight * (h * rsqrt(mean(h^2) + eps))`` with the normalized value
rounded to x's dtype before the weight multiplies it, as Hugging Face's DeepSeek RMSNorm does (or,
with ``fp32_product``, DeepSeek-V4's: an fp32 weight times the fp32 normalized value, rounded once). One
kernel replaces the ~8 elementwise and reduction kernels of the torch expression, which matters in
a decode step (each layer runs four norms) and in its CUDA graph's launch cost.

Backends (see ``flashdsa.runtime.dispatch``): ``reference`` (torch) and ``triton`` (CUDA).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.checks import check, check_tensor

__all__ = ["rms_norm"]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # fp64: reference only



def _triton_supports(same_dtype: bool = True, dtype: torch.dtype = torch.bfloat16, fp32_product: bool = False,
                     **_) -> Optional[str]:
    if dtype == torch.float64:
        return "triton rms_norm takes bf16/fp16/fp32"
    return None if same_dtype or fp32_product else "triton rms_norm takes a weight of x's dtype"


dispatch.register("rms_norm", "reference", f"{__name__}.reference:rms_norm")
dispatch.register("rms_norm", "triton", f"{__name__}.triton.rms_norm:rms_norm", _triton_supports)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor] = None, *,
             fp32_product: bool = False, backend: Optional[str] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x: [T, D] bf16/fp16/fp32/fp64 (rows may be strided, last dim contiguous); weight: [D] float
    (another dtype than x's: reference backend, the result then in the promoted dtype, as torch
    computes it), or None: ``x * rsqrt(mean(x^2) + eps)`` with the rsqrt rounded to x's dtype first
    (DeepSeek-V4's weightless normalization of each head); eps: float > 0; residual: optional
    [T, D] of x's dtype; fp32_product: y = ``(weight * normalized).to(x.dtype)`` in fp32
    (DeepSeek-V4; y always in x's dtype). Returns ``(y, h)``: y [T, D] and h = x + residual [T, D]
    (None without a residual)."""
    check_tensor("x", x, FLOAT_DTYPES, [None, None], "bf16/fp16/fp32/fp64 [T, D]", contiguous=False)
    check(x.shape[0] == 0 or x.stride(-1) == 1, f"x must have a contiguous last dim, got strides {x.stride()}")
    rows, dim = x.shape
    if weight is not None:
        check_tensor("weight", weight, FLOAT_DTYPES, [dim], f"bf16/fp16/fp32/fp64 [D={dim}] or None", x.device)
    check(isinstance(eps, float) and eps > 0, f"eps must be a float > 0, got {eps!r}")
    if residual is not None:
        check_tensor("residual", residual, x.dtype, [rows, dim], f"[T={rows}, D={dim}] like x", x.device)
    check(isinstance(fp32_product, bool), f"fp32_product must be a bool, got {fp32_product!r}")
    impl = dispatch.select("rms_norm", x.device, backend, same_dtype=weight is None or weight.dtype == x.dtype,
                           dtype=x.dtype, fp32_product=fp32_product)
    return impl(x, weight, eps, residual, fp32_product)
