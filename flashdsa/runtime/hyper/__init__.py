"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): public functions, checks, dispatch.

The residual stream is n = ``hc_mult`` parallel copies ``h: [T, n, D]``. Before a block one linear
map ``fn`` of the RMS-normalized flattened streams gives per token ``pre [n]``, ``post [n]`` and
``comb [n, n]`` (:func:`hc_pre`); the block reads ``sum_i pre_i h_i`` and its output ``y`` goes back
as ``h'_k = post_k * y + sum_j comb[j, k] h_j`` (:func:`hc_post`). ``comb`` is pushed towards a
doubly-stochastic matrix by Sinkhorn-Knopp iterations. After the last layer :func:`hc_head`
collapses the streams with its own ``pre``. All of it is fp32 but the mixing of the streams.

Backends (see ``flashdsa.runtime.dispatch``): ``reference`` (torch; differentiable, training calls
it) and ``triton`` (CUDA, n <= 8: a split-K kernel for the mixes plus one kernel per token for the
RMS scale, sigmoid / softmax / Sinkhorn in registers and the collapse; ``hc_post`` one elementwise
kernel). A decode step's ~90 small torch kernels per mHC site become three; all are CUDA-graph
capturable (no host sync). fp32 results agree with the reference to ~1e-6: the Triton path
applies the RMS scale after the GEMM (``rsqrt(mean(h^2) + eps) * (h @ fn^T)``, by linearity).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.checks import check, check_tensor
from flashdsa.runtime.hyper.reference import rms_normalize

__all__ = ["hc_pre", "hc_post", "hc_head", "rms_normalize"]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_TRITON_STREAMS = 8  # the Sinkhorn matrix and the streams of a token live in registers


def _triton_supports(n: int = 4, **_) -> Optional[str]:
    return None if n <= MAX_TRITON_STREAMS else f"triton mHC takes n <= {MAX_TRITON_STREAMS} streams, got {n}"


for _op in ("hc_pre", "hc_post", "hc_head"):
    dispatch.register(_op, "reference", f"{__name__}.reference:{_op}")
    dispatch.register(_op, "triton", f"{__name__}.triton.hyper:{_op}", _triton_supports)


def _check_streams(h: object) -> tuple[int, int, int]:
    check_tensor("h", h, FLOAT_DTYPES, [None, None, None], "bf16/fp16/fp32 [T, n, D] contiguous")
    tokens, n, dim = h.shape
    check(n > 0 and dim > 0, f"h must have n > 0 streams of D > 0, got {list(h.shape)}")
    return tokens, n, dim


def _check_mixing(h: torch.Tensor, fn: object, base: object, scale: object, width: int, scales: int) -> None:
    """fn ``[width, n D]``, base ``[width]``, scale ``[scales]``, all fp32 on h's device."""
    n_dim = h.shape[1] * h.shape[2]
    check_tensor("fn", fn, torch.float32, [width, n_dim], f"float32 [{width}, n*D={n_dim}]", h.device)
    check_tensor("base", base, torch.float32, [width], f"float32 [{width}]", h.device)
    check_tensor("scale", scale, torch.float32, [scales], f"float32 [{scales}]", h.device)


def _check_eps(hc_eps: object, norm_eps: object) -> None:
    check(isinstance(hc_eps, float) and hc_eps >= 0, f"hc_eps must be a float >= 0, got {hc_eps!r}")
    check(isinstance(norm_eps, float) and norm_eps > 0, f"norm_eps must be a float > 0, got {norm_eps!r}")


def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
           norm_eps: float, *, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site before its block.

    Args:
        h: ``[T, n, D]`` bf16/fp16/fp32 contiguous, the streams.
        fn: ``[(2+n) n, n D]`` fp32; base: ``[(2+n) n]`` fp32; scale: ``[3]`` fp32 (pre, post, comb).
        iters: Sinkhorn iterations >= 1. hc_eps: float >= 0. norm_eps: float > 0, of the RMS scale.

    Returns:
        ``(x [T, D] h.dtype, post [T, n] fp32, comb [T, n, n] fp32)`` where, with
        ``m = fn @ (flatten(h) / rms(flatten(h)))`` split ``[n | n | n n]``:
        ``x = sum_i pre_i h_i``, ``pre = sigmoid(m_pre scale_0 + base_pre) + hc_eps``,
        ``post = 2 sigmoid(m_post scale_1 + base_post)``, ``comb = sinkhorn(softmax_rows(m_comb scale_2
        + base_comb) + hc_eps)``: columns normalized, then ``iters - 1`` times rows and columns.
    """
    _, n, _ = _check_streams(h)
    _check_mixing(h, fn, base, scale, (2 + n) * n, 3)
    check(isinstance(iters, int) and not isinstance(iters, bool) and iters >= 1, f"iters must be an int >= 1, got {iters!r}")
    _check_eps(hc_eps, norm_eps)
    impl = dispatch.select("hc_pre", h.device, backend, n=n)
    return impl(h, fn, base, scale, iters, hc_eps, norm_eps)


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, *, backend: Optional[str] = None) -> torch.Tensor:
    """The final collapse of the streams: ``h: [T, n, D]`` -> ``sum_i pre_i h_i`` ``[T, D]`` in h's
    dtype, ``pre = sigmoid((fn @ (flatten(h) / rms)) scale + base) + hc_eps``; fn ``[n, n D]``,
    base ``[n]``, scale ``[1]``, fp32; eps as in :func:`hc_pre`."""
    _, n, _ = _check_streams(h)
    _check_mixing(h, fn, base, scale, n, 1)
    _check_eps(hc_eps, norm_eps)
    impl = dispatch.select("hc_head", h.device, backend, n=n)
    return impl(h, fn, base, scale, hc_eps, norm_eps)


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
            extra: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """One mHC site after its block: the new streams ``post_k * y + sum_j comb[j, k] h_j``.

    ``y: [T, D]`` the block's output (h's dtype; rows may be strided, last dim contiguous),
    ``h: [T, n, D]`` the streams the site read, ``post: [T, n]`` and ``comb: [T, n, n]`` fp32 from
    :func:`hc_pre`. ``extra``: optionally a second block output ``[T, D]`` like y (V4's shared
    expert beside the routed ones), added to y in h's dtype first: the result is bit for bit
    ``hc_post(y + extra, ...)``, without that sum's kernel. Returns ``[T, n, D]`` in h's dtype; post
    and comb are rounded to it first and the two terms each rounded before their sum, as the torch
    expression does.
    """
    tokens, n, dim = _check_streams(h)
    for name, t in (("y", y), ("extra", extra)):
        if name == "y" or t is not None:
            check_tensor(name, t, h.dtype, [tokens, dim], f"{h.dtype} [T={tokens}, D={dim}] like h", h.device,
                         contiguous=False)
            check(tokens == 0 or t.stride(-1) == 1, f"{name} must have a contiguous last dim, got strides {t.stride()}")
    check_tensor("post", post, torch.float32, [tokens, n], f"float32 [T={tokens}, n={n}]", h.device)
    check_tensor("comb", comb, torch.float32, [tokens, n, n], f"float32 [T={tokens}, n={n}, n={n}]", h.device)
    impl = dispatch.select("hc_post", h.device, backend, n=n)
    return impl(y, h, post, comb, extra)
