"""FP4 (e2m1) weights as DeepSeek ships V4's routed experts: two values a byte, one power-of-two
scale per 32 inputs.

A weight ``[rows, cols]`` is stored as int8/uint8 ``[rows, cols / 2]`` (value ``2 j`` in the low
nibble of byte ``j``, ``2 j + 1`` in the high one; a nibble is sign, 2 exponent bits, 1 mantissa
bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) and a scale ``[rows, cols / 32]`` (UE8M0,
stored as float8_e8m0fnu or as its exponent byte, or fp32). ``w = value * scale``.
"""

from __future__ import annotations

import torch

FP4_GROUP = 32  # inputs per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
UE8M0_BIAS = 127


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales from UE8M0 (float8_e8m0fnu or exponent bytes) or float scales."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - UE8M0_BIAS)
    return scale.float()


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``packed: [rows, cols / 2]`` int8/uint8, ``scale: [rows, cols / 32]`` -> fp32 ``[rows, cols]``."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() != 2:
        raise ValueError(f"FP4 weights must be int8/uint8 [rows, cols / 2], got {packed.dtype} {list(packed.shape)}")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if scale.shape != (rows, cols // FP4_GROUP) or cols % FP4_GROUP:
        raise ValueError(f"FP4 scales must be [{rows}, {cols // FP4_GROUP}] for a [{rows}, {cols}] weight "
                         f"(one per {FP4_GROUP} inputs), got {list(scale.shape)}")
    magnitude = torch.tensor(E2M1_VALUES, device=packed.device)
    table = torch.cat([magnitude, -magnitude])  # nibble -> value (bit 3 is the sign)
    byte = packed.view(torch.uint8).long()
    values = torch.stack([table[byte & 0xF], table[byte >> 4]], dim=-1).view(rows, cols)
    return (values.view(rows, -1, FP4_GROUP) * scale_values(scale).unsqueeze(-1)).view(rows, cols)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w: [rows, cols]`` -> (packed int8 ``[rows, cols / 2]``, UE8M0 scale ``[rows, cols / 32]``
    float8_e8m0fnu): scale ``2^ceil(log2(amax / 6))`` per 32 inputs, values rounded to the nearest
    e2m1 (ties to the lower magnitude)."""
    rows, cols = w.shape
    if cols % FP4_GROUP:
        raise ValueError(f"FP4 weights need cols a multiple of {FP4_GROUP}, got {list(w.shape)}")
    groups = w.float().view(rows, -1, FP4_GROUP)
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(2.0**-100)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX)))
    scaled = (groups / scale).view(rows, cols)
    magnitude = torch.tensor(E2M1_VALUES, device=w.device)
    code = (scaled.abs()[..., None] - magnitude).abs().argmin(-1)  # nearest magnitude, the lower on a tie
    code = code + 8 * (scaled < 0)
    pairs = code.view(rows, -1, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.view(rows, -1).to(torch.float8_e8m0fnu)
