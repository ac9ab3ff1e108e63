"""Activation quantizer in Triton: e4m3 with one fp32 scale per token and 128 channels.

One program takes one row and ``GROUPS`` groups of 128 channels. The scale is ``amax / 448``
(IEEE division, amax clamped at 1e-4), rounded up to a power of two from its bits with
``pow2_scales``; the values are divided by it (a power-of-two scale: multiplied by its reciprocal,
which is exact, so the product rounds to the same fp32 as the quotient) and rounded to e4m3 the
way torch rounds, so on a GPU the bytes and scales equal the reference's. :func:`quantize_groups`
is the arithmetic; the decode GEMM (``gemm.py``) runs it on its own tiles too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.cache.triton.writes import _pow2_ceil, _round_to_e4m3_bytes
from flashdsa.runtime.fp8 import AMAX_FLOOR, E4M3, E4M3_MAX
from flashdsa.runtime.gemm.reference import GROUP

GROUPS_PER_PROGRAM = 8


@triton.jit
def quantize_groups(x, amax_floor, e4m3_max, POW2: tl.constexpr):
    """x: [R, C] float, one 128-channel group a row (zeros past K) -> (e4m3 codes [R, C] uint8,
    scale [R] fp32): ``amax / 448`` per row (amax clamped at amax_floor), rounded up to a power
    of two with POW2; the codes are ``x / scale`` rounded like torch's cast."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), amax_floor), e4m3_max)
    if POW2:
        scale = _pow2_ceil(scale)
        scaled = x * tl.math.div_rn(1.0, scale)[:, None]  # 2^-e is exact: the product is the quotient
    else:
        scaled = tl.math.div_rn(x, scale[:, None])
    return _round_to_e4m3_bytes(scaled), scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, K, num_groups, stride_x, amax_floor, e4m3_max,
                     GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, POW2: tl.constexpr):
    """Row m, groups [j * GROUPS, (j + 1) * GROUPS) of x: [M, K] -> q: [M, K] uint8, scale: [M, groups]."""
    m = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    inside = cols < K
    x = tl.load(x_ptr + m * stride_x + cols, mask=inside, other=0.0)
    codes, scale = quantize_groups(x, amax_floor, e4m3_max, POW2)
    tl.store(q_ptr + m * K + cols, codes, mask=inside)
    tl.store(scale_ptr + m * num_groups + groups, scale, mask=groups < num_groups)


def quantize_activations(x: torch.Tensor, pow2_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] bf16/fp16/fp32 (rows may be strided) -> (e4m3 [M, K], fp32 [M, ceil(K/128)])."""
    m, k = x.shape
    num_groups = triton.cdiv(k, GROUP)
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    scale = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    x = x if x.stride(1) == 1 else x.contiguous()
    groups = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(num_groups))
    _quantize_kernel[(m, triton.cdiv(num_groups, groups))](
        x, q.view(torch.uint8), scale, k, num_groups, x.stride(0), AMAX_FLOOR, E4M3_MAX,
        GROUPS=groups, GROUP_SIZE=GROUP, POW2=pow2_scales, num_warps=4,
    )
    return q, scale
