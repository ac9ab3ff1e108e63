"""Linear layers whose weights stay in the checkpoint's precision.

``FP8Linear`` keeps an e4m3 weight ``[out, in]`` and its ``weight_scale_inv`` (one fp32 scale per
128x128 block), the official DeepSeek checkpoints' format, one byte per weight in memory. In
production mode it runs the block-scaled FP8 GEMM of ``flashdsa.runtime.gemm`` (activations
quantized per token and 128 channels); in reference mode it dequantizes the weight for the one
call and multiplies in the activations' precision, so the result matches a dequantized checkpoint.
``FP8GroupedLinear`` is the same for a grouped projection (DeepSeek-V4's ``wo_a``): one FP8 GEMM
per group over that group's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP, dequantize_weight, fp8_linear

SCALE_SUFFIX = "_scale_inv"  # checkpoint name of an e4m3 tensor's block scales: "<name>_scale_inv"


class FP8Linear(nn.Module):
    """``y = x W^T`` with ``W = weight (e4m3) * weight_scale_inv`` per 128x128 block."""

    def __init__(self, in_features: int, out_features: int, quantize_activations: bool = True,
                 pow2_scales: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantize_activations, self.pow2_scales = quantize_activations, pow2_scales
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=E4M3), requires_grad=False)
        scale_shape = (-(-out_features // GROUP), -(-in_features // GROUP))
        self.register_buffer("weight" + SCALE_SUFFIX, torch.empty(scale_shape, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.weight, self.weight_scale_inv)

    def _matmul(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x: [..., K] @ (w: [N, K] e4m3 * its block scales)^T`` -> ``[..., N]`` in x's dtype."""
        if self.quantize_activations:
            return fp8_linear(x, w, scale, pow2_scales=self.pow2_scales)
        return F.linear(x, dequantize_weight(w, scale).to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block 128x128"


class FP8GroupedLinear(FP8Linear):
    """``x: [S, groups, in] -> [S, groups * out]``: group g's ``in`` features through the weight rows
    ``[g*out, (g+1)*out)`` (e4m3, ``[groups * out, in]`` with its 128x128 block scales). ``out`` must
    be a multiple of 128, so that every group owns whole scale blocks; each group is one FP8 GEMM."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int, quantize_activations: bool = True,
                 pow2_scales: bool = False):
        if out_per_group % GROUP:
            raise ValueError(f"FP8 grouped weights need out_per_group a multiple of {GROUP}, got {out_per_group}")
        super().__init__(in_per_group, groups * out_per_group, quantize_activations, pow2_scales)
        self.groups, self.out_per_group = groups, out_per_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, blocks = self.out_per_group, self.out_per_group // GROUP
        return torch.cat([self._matmul(x[:, g], self.weight[g * rows:(g + 1) * rows],
                                       self.weight_scale_inv[g * blocks:(g + 1) * blocks])
                          for g in range(self.groups)], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, groups={self.groups}"


def replace_linears(model: nn.Module, names: set[str], quantize_activations: bool, pow2_scales: bool) -> None:
    """Swap the ``nn.Linear`` modules named in ``names`` (module paths) for :class:`FP8Linear`."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        setattr(parent, child, FP8Linear(old.in_features, old.out_features, quantize_activations, pow2_scales))
