"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4, and the norms they use.

The residual stream is ``hc_mult`` parallel copies ``h: [T, n, D]``. Before a block, one linear
map of the RMS-normalized flattened streams gives per token ``pre [n]``, ``post [n]`` and
``comb [n, n]``: the block reads ``sum_i pre_i h_i``, and its output ``y`` goes back as
``h'_k = post_k * y + sum_j comb[j, k] h_j``. ``comb`` is pushed towards a doubly-stochastic
matrix by Sinkhorn-Knopp iterations so the mixing cannot blow the residual up. After the last
layer :class:`HyperHead` collapses the streams with its own ``pre``. All of it runs in fp32 (under
autocast too) but the final mixing of the streams, which runs in their dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, computed in fp32, returned in x's dtype (no weight)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight: normalize in fp32, multiply in fp32, cast once at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


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


class HyperConnection(nn.Module):
    """One mHC site (before attention or before the MoE). ``fn: [(2+n)n, nD]``, ``base: [(2+n)n]``,
    ``scale: [3]`` (pre, post, comb), fp32."""

    def __init__(self, hidden: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h: [T, n, D]`` -> ``(block input [T, D] in h's dtype, post [T, n], comb [T, n, n])`` fp32."""
        n = self.n
        mixes = fp32_linear(rms_normalize(h.flatten(1).float(), self.norm_eps), self.fn)  # [T, (2+n)n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        collapsed = (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)
        return collapsed, post, sinkhorn(comb, self.iters, self.hc_eps)

    @staticmethod
    def expand(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams ``post_k * y + sum_j comb[j, k] h_j``; ``y: [T, D]``, ``h: [T, n, D]``."""
        dtype = h.dtype
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


class HyperHead(nn.Module):
    """Final collapse of the streams: ``sum_i (sigmoid(m_i * scale + base_i) + eps) h_i`` with
    ``m = hc_fn @ rms_normalize(flatten(h))``; ``hc_fn: [n, nD]``, ``hc_base: [n]``, ``hc_scale: [1]``."""

    def __init__(self, hidden: int, hc_mult: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h: [T, n, D]`` -> ``[T, D]`` in h's dtype."""
        mixes = fp32_linear(rms_normalize(h.flatten(1).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)
