"""Rotary position embedding with YaRN, in DeepSeek's two layouts.

MLA rotates interleaved pairs ``(x0, x1), (x2, x3), ...``; the indexer rotates the two halves
``(x_i, x_{i+d/2})`` ("rotate-half"). Both use the same frequencies: ``qk_rope_head_dim / 2`` of
them, YaRN-blended between the original and the ``factor``-interpolated ones. The rotations
themselves are ``flashdsa.runtime.rope`` (torch expressions, or one fused kernel).
"""

from __future__ import annotations

import math

import torch

from flashdsa.models.config import DeepseekV32Config
from flashdsa.runtime.rope import apply_rope_, cos_sin, rotate


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

    def at(self, positions: torch.Tensor, fused: bool = False) -> "RopeAt":
        """RoPE at ``positions: [T]`` int; ``fused``: one in-place kernel (``runtime.rope``; no autograd),
        else the differentiable torch expressions."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        return RopeAt(positions, inv_freq, self.attention_factor, fused)


class RopeAt:
    """Rotates (q, k) pairs at one batch's positions; ``rope(q, k, interleaved) -> (q, k)``.

    q: [T, H, D], k: [T, D]; the first ``qk_rope_head_dim`` dims of each are rotated, interleaved
    (MLA) or rotate-half (the indexer). Fused, q and k are rotated in place and returned; else
    new tensors come back and the fp32 ``cos, sin: [T, rope_dim / 2]`` are computed once."""

    def __init__(self, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, fused: bool):
        self.positions, self.inv_freq, self.attention_factor, self.fused = positions, inv_freq, attention_factor, fused
        self.cos_sin = None if fused else cos_sin(positions, inv_freq, attention_factor)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            apply_rope_(q, k, self.positions, self.inv_freq, self.attention_factor, interleaved)
            return q, k
        return rotate(q, *self.cos_sin, interleaved), rotate(k, *self.cos_sin, interleaved)

    def rotate_tail(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x: [T, ..., D]`` with its trailing ``R`` dims rotated as interleaved pairs (DeepSeek-V4 lays
        a head out as ``[nope | rope]``); ``inverse`` turns them back. Fused: in place, one kernel
        (x is returned); else a new tensor."""
        dims = 2 * self.inv_freq.shape[0]
        if self.fused:
            if x.numel():
                apply_rope_(x.view(x.shape[0], -1, x.shape[-1])[..., -dims:], None, self.positions, self.inv_freq,
                            self.attention_factor, True, inverse=inverse)
            return x
        cos, sin = self.cos_sin
        return torch.cat([x[..., :-dims], rotate(x[..., -dims:], cos, -sin if inverse else sin, True)], dim=-1)
