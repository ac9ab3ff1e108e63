"""Reference RMSNorm (torch): the computation of Hugging Face's DeepSeek RMSNorm."""

from __future__ import annotations

from typing import Optional

import torch


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor],
             fp32_product: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    h = x if residual is None else x + residual
    hf = h.float()
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h * rstd.to(x.dtype), (None if residual is None else h)
    normed = hf * rstd
    y = (weight.float() * normed).to(x.dtype) if fp32_product else weight * normed.to(x.dtype)
    return y, (None if residual is None else h)
