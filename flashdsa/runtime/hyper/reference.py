"""Reference (torch) manifold-constrained hyper-connections: the equations of DeepSeek-V4's mHC.

Plain torch, so autograd runs through it (training uses these functions directly); everything but
the final mixing of the streams is fp32, under autocast too. ``h: [T, n, D]`` are the n streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, computed in fp32, returned in x's dtype (no weight)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` in fp32 even under autocast (training's bf16 autocast would round the mixing
    weights, which DeepSeek-V4 computes in fp32)."""
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``comb: [..., n, n]`` positive -> columns, then ``iters - 1`` times rows and columns, normalized to 1."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def _mixes(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``[T, W]`` fp32: ``fn`` applied to the RMS-normalized flattened streams."""
    return fp32_linear(rms_normalize(h.flatten(1).float(), norm_eps), fn)


def _collapse(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``sum_i pre_i h_i`` in fp32, cast to h's dtype: ``[T, D]``."""
    return (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)


def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
           norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum_i pre_i h_i [T, D] h.dtype, post [T, n], comb [T, n, n])``, see ``flashdsa.runtime.hyper.hc_pre``."""
    n = h.shape[1]
    pre_w, post_w, comb_w = _mixes(h, fn, norm_eps).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    return _collapse(pre, h), post, sinkhorn(comb, iters, hc_eps)


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """``sum_i (sigmoid(m_i * scale + base_i) + hc_eps) h_i`` ``[T, D]``, see ``flashdsa.runtime.hyper.hc_head``."""
    return _collapse(torch.sigmoid(_mixes(h, fn, norm_eps) * scale + base) + hc_eps, h)


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            extra: torch.Tensor | None = None) -> torch.Tensor:
    """The new streams ``post_k * y + sum_j comb[j, k] h_j`` ``[T, n, D]``, in h's dtype (``extra``
    added to y first)."""
    dtype = h.dtype
    y = y if extra is None else y + extra
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)
