"""Rotary position embedding with YaRN, in DeepSeek's two layouts.

MLA rotates interleaved pairs ``(x0, x1), (x2, x3), ...``; the indexer rotates the two halves
``(x_i, x_{i+d/2})`` ("rotate-half"). Both use the same frequencies: ``qk_rope_head_dim / 2`` of
them, YaRN-blended between the original and the ``factor``-interpolated ones.
"""

from __future__ import annotations

import math

import torch

from flashdsa.models.config import DeepseekV32Config


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class Rotary:
    """Frequencies for ``config.qk_rope_head_dim`` rotary dims; ``cos_sin(positions)`` gives the angles."""

    def __init__(self, config: DeepseekV32Config):
        dim, base = config.qk_rope_head_dim, config.rope_theta
        wavelength = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)  # [dim / 2]
        freq = 1.0 / wavelength
        self.attention_factor = 1.0
        yarn = config.rope_scaling or {}
        if yarn.get("type", yarn.get("rope_type")) == "yarn":
            factor = yarn["factor"]
            original = yarn["original_max_position_embeddings"]
            # Dimensions rotating fewer than beta_slow times over the original context are fully
            # interpolated, more than beta_fast times untouched, linear in between.
            beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

            def dim_of(rotations: float) -> float:
                return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(dim_of(beta_fast)), 0)
            high = min(math.ceil(dim_of(beta_slow)), dim - 1)
            ramp = (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 1e-3)
            ramp = ramp.clamp(0, 1)
            keep = 1 - ramp  # 1: keep the original frequency (extrapolate), 0: interpolate
            freq = 1.0 / (factor * wavelength) * (1 - keep) + freq * keep
            mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
            if yarn.get("attention_factor") is not None:
                self.attention_factor = yarn["attention_factor"]
            elif mscale and mscale_all_dim:
                self.attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                self.attention_factor = _yarn_mscale(factor)
        self.inv_freq = freq
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # device copies, made once (graph capture forbids copies)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions: [T]`` int -> ``(cos, sin)`` each ``[T, rope_dim / 2]`` fp32."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.float()[:, None] * inv_freq[None, :]
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


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
