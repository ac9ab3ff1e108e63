"""RMSNorm (with the residual add) in Triton: one program per row, the row in registers."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, dim, stride_x, stride_r, stride_y, stride_h, eps,
                     RESIDUAL: tl.constexpr, FP32_PRODUCT: tl.constexpr, WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    if RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=inside, other=0.0)  # rounded like torch's add
        tl.store(h_ptr + row * stride_h + cols, x, mask=inside)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / dim + eps)
    if WEIGHT:
        normed = xf * rstd
        if not FP32_PRODUCT:
            normed = normed.to(x.dtype).to(tl.float32)  # rounded before the weight, as the torch expression is
        y = normed * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    else:  # x * rstd, the rsqrt rounded to x's dtype first (a product of two x-dtype values)
        y = xf * (tl.full([BLOCK], 1.0, tl.float32) * rstd).to(x.dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(x.dtype), mask=inside)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor],
             fp32_product: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    rows, dim = x.shape
    y = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    h = None if residual is None else torch.empty_like(y)
    if rows == 0:
        return y, h
    block = triton.next_power_of_2(dim)
    res = x if residual is None else residual
    out_h = y if h is None else h
    _rms_norm_kernel[(rows,)](x, res, x if weight is None else weight, y, out_h, dim, x.stride(0), res.stride(0), y.stride(0), out_h.stride(0),
                              eps, RESIDUAL=residual is not None, FP32_PRODUCT=fp32_product, WEIGHT=weight is not None,
                              BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return y, h
