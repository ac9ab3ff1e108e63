"""Linear layers whose weights stay in the checkpoint's precision.

``FP8Linear`` keeps an e4m3 weight ``[out, in]`` and its ``weight_scale_inv`` (one fp32 scale per
128x128 block), the official DeepSeek checkpoints' format, one byte per weight in memory. In
production mode it runs the block-scaled FP8 GEMM of ``flashdsa.runtime.gemm`` (activations
quantized per token and 128 channels); in reference mode it dequantizes the weight for the one
call and multiplies in the activations' precision, so the result matches a dequantized checkpoint.
``FP8GroupedLinear`` is the same for a grouped projection (DeepSeek-V4's ``wo_a``): one FP8 GEMM
per group over that group's rows. ``FusedLinear`` runs several layers that read the same input as
one GEMM (inference only).
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashdsa.runtime.dense import dense_linear
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP, dequantize_weight, fp8_linear

SCALE_SUFFIX = "_scale_inv"  # checkpoint name of an e4m3 tensor's block scales: "<name>_scale_inv"


def block_scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, quantize_activations: bool,
                        pow2_scales: bool) -> torch.Tensor:
    """``x: [..., in]`` through the e4m3 ``weight: [out, in]`` with 128x128 block ``scale`` -> ``[..., out]``:
    the FP8 GEMM on quantized activations, or (``quantize_activations=False``) the dequantized weight."""
    if quantize_activations:
        return fp8_linear(x, weight, scale, pow2_scales=pow2_scales)
    return F.linear(x, dequantize_weight(weight, scale).to(x.dtype))


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
        return block_scaled_linear(x, w, scale, self.quantize_activations, self.pow2_scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block 128x128"


class FP8GroupedLinear(FP8Linear):
    """``x: [S, groups, in] -> [S, groups * out]``: group g's ``in`` features through the weight rows
    ``[g*out, (g+1)*out)`` (e4m3, ``[groups * out, in]`` with its 128x128 block scales). ``out`` must
    be a multiple of 128, so that every group owns whole scale blocks. In production mode the groups
    are one grouped FP8 GEMM (``fp8_linear(groups=...)``: one launch at decode sizes)."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int, quantize_activations: bool = True,
                 pow2_scales: bool = False):
        if out_per_group % GROUP:
            raise ValueError(f"FP8 grouped weights need out_per_group a multiple of {GROUP}, got {out_per_group}")
        super().__init__(in_per_group, groups * out_per_group, quantize_activations, pow2_scales)
        self.groups, self.out_per_group = groups, out_per_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_activations and self.in_features % GROUP == 0:
            return fp8_linear(x.flatten(-2), self.weight, self.weight_scale_inv, groups=self.groups,
                              pow2_scales=self.pow2_scales)
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


class FusedLinear(nn.Module):
    """Linear layers that read the same input, run as one GEMM (one activation quantization, one
    launch): ``forward(x: [..., in]) -> (y_1, ..., y_n)`` with ``y_i: [..., out_i]`` (strided views).

    Built once the parts are loaded on their device: the parts' weights (and FP8 block scales) become
    row views of the fused ones, so no memory is added, the parts keep their names, state-dict entries
    and autograd use, and an in-place update of either side shows in the other. The fused tensors are
    non-persistent buffers (not in the state dict); moving the model afterwards copies them apart
    (still correct, the memory no longer shared). See :func:`fusion_refusal` for what fuses.
    """

    def __init__(self, parts: Sequence[nn.Module]):
        super().__init__()
        reason = fusion_refusal(parts)
        if reason is not None:
            raise ValueError(f"cannot fuse these linear layers: {reason}")
        first = parts[0]
        self.sizes = [p.out_features for p in parts]
        self._latest: Optional[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = None  # (input, outputs)
        self.fp8 = isinstance(first, FP8Linear)
        self.register_buffer("weight", torch.cat([p.weight.detach() for p in parts]), persistent=False)
        for part, rows in zip(parts, self.weight.split(self.sizes)):
            part.weight.data = rows
        if self.fp8:
            self.quantize_activations, self.pow2_scales = first.quantize_activations, first.pow2_scales
            scales = [p.weight_scale_inv for p in parts]
            self.register_buffer("weight" + SCALE_SUFFIX, torch.cat(scales), persistent=False)
            for part, blocks in zip(parts, self.weight_scale_inv.split([s.shape[0] for s in scales])):
                part.weight_scale_inv = blocks

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fp8:
            y = block_scaled_linear(x, self.weight, self.weight_scale_inv, self.quantize_activations, self.pow2_scales)
        else:
            y = dense_linear(x, self.weight)
        return y.split(self.sizes, -1)

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts' outputs for ``x``: the fused GEMM runs once per input (the latest is kept)."""
        latest = self._latest
        if latest is None or latest[0] is not x:
            latest = self._latest = (x, self(x))
        return latest[1]

    def serve_parts(self, parts: Sequence[nn.Module]) -> None:
        """Make each of ``parts`` (this fusion's, in order) answer from the fused GEMM wherever it is
        called: the first part called with an input runs the GEMM for all of them, the others take
        their slice while that input is the latest (inference only: autograd would see the parts'
        own weights unused)."""
        for index, part in enumerate(parts):
            part.forward = partial(_fused_part, self, index)

    def extra_repr(self) -> str:
        return f"out_features={'+'.join(map(str, self.sizes))}{', fp8 block 128x128' if self.fp8 else ''}"


def _fused_part(fused: FusedLinear, index: int, x: torch.Tensor) -> torch.Tensor:
    """Part ``index``'s output for ``x``: a slice of the fused GEMM, run once per input."""
    return fused.outputs(x)[index]


def fuse_shared_input(owner: nn.Module, parts: Sequence[nn.Module]) -> None:
    """At inference, run the linear layers ``parts``, which all read one input, as one GEMM per kind
    (FP8 or plain; :meth:`FusedLinear.serve_parts`), each registered on ``owner``; a part whose width
    is off the 128-row scale blocks goes last. Kinds that cannot fuse stay as they are. Idempotent."""
    for kind in (FP8Linear, nn.Linear):
        name = f"fused_{kind.__name__.lower()}"
        group = sorted((p for p in parts if type(p) is kind), key=lambda p: p.out_features % GROUP != 0)
        if not hasattr(owner, name) and fusion_refusal(group) is None:
            fused = FusedLinear(group)
            fused.serve_parts(group)
            owner.add_module(name, fused)


def fusion_refusal(parts: Sequence[nn.Module]) -> Optional[str]:
    """Why ``parts`` cannot run as one :class:`FusedLinear`, or None. They must be all bias-free
    ``nn.Linear`` or all ``FP8Linear`` quantizing activations alike, with one input width, dtype and
    device; FP8 parts but the last must end on a 128-row scale block, or a fused block would mix two
    parts' scales."""
    kinds = {type(p) for p in parts}
    if len(parts) < 2 or len(kinds) != 1 or kinds.pop() not in (nn.Linear, FP8Linear):
        return f"needs two or more layers, all nn.Linear or all FP8Linear, got {[type(p).__name__ for p in parts]}"
    if any(getattr(p, "bias", None) is not None for p in parts):
        return "a layer has a bias"
    if len({(p.in_features, p.weight.dtype, p.weight.device) for p in parts}) != 1:
        return f"input widths, dtypes or devices differ: {[(p.in_features, p.weight.dtype, p.weight.device) for p in parts]}"
    if isinstance(parts[0], FP8Linear):
        if len({(p.quantize_activations, p.pow2_scales) for p in parts}) != 1:
            return "the layers quantize their activations differently"
        if any(p.out_features % GROUP for p in parts[:-1]):
            return f"FP8 parts but the last need out_features % {GROUP} == 0, got {[p.out_features for p in parts]}"
    return None
