"""FP8 e4m3 quantization with one fp32 scale per group of the last dimension.

Two scale rules, both from DeepSeek-V3.2: the MLA latent cache uses ``amax / 448`` per 128-value
tile; the indexer uses power-of-two scales ``2^ceil(log2(amax / 448))`` ("ue8m0"), so that a
scale multiplies exactly. ``amax`` is clamped at ``AMAX_FLOOR`` so all-zero groups stay finite.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def quantize_e4m3(x: torch.Tensor, group: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x: [..., n]`` in groups of ``group`` along the last dim.

    Returns ``(q: [..., n] e4m3, scale: [..., n // group] fp32)`` with ``x ~= q * scale``.
    """
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"last dim of x ({n}) must be a multiple of group ({group})")
    g = x.float().unflatten(-1, (n // group, group))
    amax = g.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # Divide by a tensor, not a Python scalar: CUDA turns a scalar divisor into a multiply by its
    # rounded reciprocal, which is 1 ulp off the correctly rounded amax / 448 (CPU) half the time.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (g / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.flatten(-2), scale


def dequantize_e4m3(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_e4m3`: ``q: [..., n]`` e4m3, ``scale: [..., n // group]`` -> fp32."""
    groups = scale.shape[-1]
    g = q.float().unflatten(-1, (groups, q.shape[-1] // groups))
    return (g * scale.unsqueeze(-1)).flatten(-2)
