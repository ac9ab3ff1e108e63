"""Rotary position embedding of q and k at once, in place: public function, checks, dispatch.

``apply_rope_(q, k, positions, inv_freq, attention_factor, interleaved)`` rotates the first
``R = 2 * len(inv_freq)`` dims of every q head and of k by the angles ``position * inv_freq``
(fp32), cos/sin scaled by ``attention_factor`` and cast to the activations' dtype, pairs either
interleaved ``(x[2i], x[2i+1])`` (MLA) or rotate-half ``(x[i], x[i + R/2])`` (the indexer). One
kernel replaces the ~8 elementwise kernels of each torch rotation plus the cos/sin computation and
the split/cat around them: a decode step runs two ropes a layer.

Backends (see ``flashdsa.runtime.dispatch``): ``reference`` (torch, the models' expressions) and
``triton`` (CUDA; within an ulp of the reference: one rounding of ``a*c - b*s`` where torch rounds
three times). ``cos_sin`` and ``rotate`` are those torch expressions out of place, for autograd
(training) and reference mode.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.checks import check, check_tensor
from flashdsa.runtime.rope.reference import cos_sin, rotate

__all__ = ["apply_rope_", "cos_sin", "rotate"]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _triton_supports(half: int = 32, **_) -> Optional[str]:
    return None if half & (half - 1) == 0 else f"triton rope takes a power-of-two number of frequencies, got {half}"


dispatch.register("apply_rope_", "reference", f"{__name__}.reference:apply_rope_")
dispatch.register("apply_rope_", "triton", f"{__name__}.triton.rope:apply_rope_", _triton_supports)


def apply_rope_(q: torch.Tensor, k: Optional[torch.Tensor], positions: torch.Tensor, inv_freq: torch.Tensor,
                attention_factor: float, interleaved: bool, *, inverse: bool = False,
                backend: Optional[str] = None) -> None:
    """Rotate q and k in place; graph-capturable (no host sync).

    q: [T, H, D] bf16/fp16/fp32, k: [T, D] of q's dtype or None (q alone); rows and heads may be
    strided (views of a fused projection, or of a wider head's trailing dims), the last dim
    contiguous; q and k must not overlap. ``inverse`` rotates by the negated angles (undoes a
    rotation: V4 turns its attention output back).
    positions: [T] int32/int64, each token's position; inv_freq: [R/2] fp32 with R <= D.
    attention_factor: finite float multiplying cos and sin (YaRN's mscale ratio, else 1.0).
    interleaved: True rotates pairs (x[2i], x[2i+1]) (MLA), False pairs (x[i], x[i + R/2]).
    Dims [R, D) are left as they are.
    """
    check_tensor("q", q, FLOAT_DTYPES, [None, None, None], "bf16/fp16/fp32 [T, H, D]", contiguous=False)
    tokens, _, dim = q.shape
    if k is not None:
        check_tensor("k", k, q.dtype, [tokens, dim], f"[T={tokens}, D={dim}] of q's dtype", q.device, contiguous=False)
    for name, t in (("q", q), ("k", k if k is not None else q)):
        check(t.numel() == 0 or t.stride(-1) == 1, f"{name} must have a contiguous last dim, got strides {t.stride()}")
    check_tensor("positions", positions, (torch.int32, torch.int64), [tokens], f"int32/int64 [T={tokens}]", q.device)
    check_tensor("inv_freq", inv_freq, torch.float32, [None], f"fp32 [R/2] with R <= D={dim}", q.device)
    check(1 <= inv_freq.shape[0] and 2 * inv_freq.shape[0] <= dim,
          f"inv_freq must be fp32 [R/2] with 2 <= R <= D={dim}, got {inv_freq.shape[0]} frequencies")
    is_number = isinstance(attention_factor, (int, float)) and not isinstance(attention_factor, bool)
    check(is_number and math.isfinite(attention_factor),
          f"attention_factor must be a finite number, got {attention_factor!r}")
    check(isinstance(interleaved, bool), f"interleaved must be a bool, got {interleaved!r}")
    check(isinstance(inverse, bool), f"inverse must be a bool, got {inverse!r}")
    impl = dispatch.select("apply_rope_", q.device, backend, half=inv_freq.shape[0])
    impl(q, k, positions, inv_freq, float(attention_factor), interleaved, inverse)
