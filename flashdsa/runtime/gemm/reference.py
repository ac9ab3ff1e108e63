"""Reference FP8 block-scaled GEMM and quantizers (torch, fp32 math, any device): the ground truth."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdsa.runtime.fp8 import AMAX_FLOOR, E4M3, E4M3_MAX

GROUP = 128  # channels per activation scale; rows and columns per weight-scale block


def _pad_to_groups(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-pad ``dim`` of a 2-D tensor up to a multiple of GROUP."""
    pad = -x.shape[dim] % GROUP
    if not pad:
        return x
    return F.pad(x, (0, pad) if dim == 1 else (0, 0, 0, pad))


def _scale_of(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """``amax / 448`` (amax clamped at 1e-4), or with ``pow2`` the smallest power of two >= it,
    found exactly from the mantissa (``exp2(ceil(log2(s)))`` can round a scale just above a power
    of two down to it)."""
    scale = amax.clamp_min(AMAX_FLOOR) / torch.full_like(amax, E4M3_MAX)
    if not pow2:
        return scale
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).int())


def quantize_activations(x: torch.Tensor, pow2_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    groups = -(-k // GROUP)
    g = _pad_to_groups(x.float(), 1).view(m, groups, GROUP)
    scale = _scale_of(g.abs().amax(-1), pow2_scales)  # [M, groups]
    q = (g / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(m, groups * GROUP)[:, :k].contiguous(), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    blocks = _pad_to_groups(_pad_to_groups(w.float(), 0), 1)
    nb, kb = blocks.shape[0] // GROUP, blocks.shape[1] // GROUP
    tiles = blocks.view(nb, GROUP, kb, GROUP)
    scale = _scale_of(tiles.abs().amax(dim=(1, 3)), pow2=False)  # [N/128, K/128]
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(nb * GROUP, kb * GROUP)[:n, :k].contiguous(), scale


def dequantize_weight(w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``w_fp8: [N, K]`` e4m3 and its 128x128 block scales -> fp32 ``[N, K]``."""
    n, k = w_fp8.shape
    scale = w_scale.repeat_interleave(GROUP, 0)[:n].repeat_interleave(GROUP, 1)[:, :k]
    return w_fp8.float() * scale


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    k = x_fp8.shape[1]
    x = x_fp8.float() * x_scale.repeat_interleave(GROUP, 1)[:, :k]
    return (x @ dequantize_weight(w_fp8, w_scale).T).to(out_dtype)
