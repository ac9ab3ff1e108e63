"""Reference RoPE (torch): the differentiable expressions of the models and training.

The angles are fp32 (``position * inv_freq``), their cos/sin are scaled by the YaRN attention
factor and cast to the activations' dtype before they multiply, as Hugging Face's DeepSeek does;
each product and sum is then rounded to that dtype, as torch's elementwise ops round.
"""

from __future__ import annotations

import torch


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions: [T]`` int, ``inv_freq: [R/2]`` fp32 -> ``(cos, sin)`` each ``[T, R/2]`` fp32."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])`` of ``x: [T, ..., d]`` by angle i; ``cos, sin: [T, d/2]``."""
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[i], x[i + d/2])`` of ``x: [T, ..., d]`` by angle i; ``cos, sin: [T, d/2]``."""
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _broadcast(angle: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[T, d/2]`` fp32 -> ``[T, 1, ..., d/2]`` in x's dtype (HF casts cos/sin to the activations' dtype)."""
    return angle.view(angle.shape[0], *([1] * (x.dim() - 2)), angle.shape[1]).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x: [T, ..., D]`` with its first ``R = 2 * cos.shape[1]`` dims rotated (the rest as they are)."""
    rope = rope_interleaved if interleaved else rope_rotate_half
    dims = 2 * cos.shape[1]
    if dims == x.shape[-1]:
        return rope(x, cos, sin)
    rot, rest = x.split([dims, x.shape[-1] - dims], dim=-1)
    return torch.cat([rope(rot, cos, sin), rest], dim=-1)


def apply_rope_(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor,
                attention_factor: float, interleaved: bool, inverse: bool = False) -> None:
    cos, sin = cos_sin(positions, inv_freq, attention_factor)
    for x in (q,) if k is None else (q, k):
        x.copy_(rotate(x, cos, -sin if inverse else sin, interleaved))
