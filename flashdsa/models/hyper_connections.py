"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4 as modules, and the norms they use.

The equations are ``flashdsa.runtime.hyper`` (its module docstring). The modules hold the weights
and pick the path: when no gradient is needed (the engine, generation, evaluation) the op's
dispatch runs (fused Triton kernels on a GPU, torch on a CPU); under autograd (training) the
differentiable torch reference. Both are sync-free and CUDA-graph capturable.
"""

from __future__ import annotations

import torch
from torch import nn

from flashdsa.runtime.hyper import hc_head, hc_post, hc_pre, rms_normalize
from flashdsa.runtime.norm import rms_norm

__all__ = ["RMSNorm", "HyperConnection", "HyperHead", "normalize_heads"]


def _needs_autograd(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _backend(*tensors: torch.Tensor) -> str | None:
    """``"reference"`` (differentiable torch) when autograd must see the computation, else None (dispatch)."""
    return "reference" if _needs_autograd(*tensors) else None


def _fused_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, **options) -> torch.Tensor | None:
    """``runtime.norm.rms_norm`` over the last dim of ``x: [..., D]``, or None where the torch
    expression must run instead (autograd must see it, or fp64, which the kernel does not take)."""
    if _needs_autograd(x, *([] if weight is None else [weight])) or x.dtype == torch.float64:
        return None
    return rms_norm(x.reshape(-1, x.shape[-1]), weight, float(eps), **options)[0].view(x.shape)


def normalize_heads(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_normalize`` over the last dim of ``x: [..., D]`` (no weight); without autograd one fused
    kernel (``runtime.norm.rms_norm`` with no weight; ~7 torch kernels else)."""
    y = _fused_norm(x, None, eps)
    return rms_normalize(x, eps) if y is None else y


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight: normalize in fp32, multiply in fp32, cast once at the end. Without
    autograd, one fused kernel (``runtime.norm.rms_norm``'s ``fp32_product``; ~8 torch kernels else)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _fused_norm(x, self.weight, self.eps, fp32_product=True)
        if y is not None:
            return y
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


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
        return hc_pre(h.contiguous(), self.fn, self.base, self.scale, self.iters, float(self.hc_eps),
                      float(self.norm_eps), backend=_backend(h, self.fn, self.base, self.scale))

    @staticmethod
    def expand(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
               extra: torch.Tensor | None = None) -> torch.Tensor:
        """The new streams ``post_k * y + sum_j comb[j, k] h_j``; ``y: [T, D]``, ``h: [T, n, D]``;
        ``extra: [T, D]`` a second block output added to y (in the same kernel without autograd)."""
        tensors = (y, h, post, comb) + (() if extra is None else (extra,))
        return hc_post(y, h.contiguous(), post, comb, extra=extra, backend=_backend(*tensors))


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
        return hc_head(h.contiguous(), self.hc_fn, self.hc_base, self.hc_scale, float(self.hc_eps),
                       float(self.norm_eps), backend=_backend(h, self.hc_fn, self.hc_base, self.hc_scale))
