"""Which DeepSeek-V4 weights stay in the checkpoint's precision in production mode, and how they are read.

The release stores its linears as e4m3 with one UE8M0 scale per 128x128 block and its routed
experts as packed FP4 (``runtime.fp4``). In production mode (``load_v4_model(keep_fp8=True)``),
before the model's storage is allocated, :func:`keep_quantized` gives:

- every ``nn.Linear`` whose checkpoint weight is e4m3 an :class:`~flashdsa.models.linear.FP8Linear`
  (the block-scaled FP8 GEMM of ``runtime.gemm``; activations quantized per token and 128 channels,
  power-of-two scales under ``scale_fmt: ue8m0``);
- the grouped output projection (``wo_a``, a ``GroupedLinear`` whose weight the attention reads as
  ``[groups, out, in]``) an :class:`~flashdsa.models.linear.FP8GroupedLinear` when ``o_lora_rank``
  is a multiple of 128 (V4-Flash: 1024), so each group owns whole scale blocks; otherwise (the
  tiny test models) it stays dequantized, which is logged;
- the routed experts e4m3 stacks (``moe_intermediate_size`` a multiple of 128: a scale block must
  not straddle an expert's gate and up rows) or packed FP4 stacks, for ``fused_moe``.

Everything else (bf16 tensors, fp32 parts) is read as today. The load loop copies a kept tensor's
bytes and its scales as they are (:func:`read_quantized`): UE8M0 scales are exact as fp32 (FP8)
and kept as exponent bytes (FP4).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flashdsa.models.deepseek_v4_attention import GroupedLinear
from flashdsa.models.deepseek_v4_config import DeepseekV4Config
from flashdsa.models.deepseek_v4_moe import Experts
from flashdsa.models.linear import FP8GroupedLinear, FP8Linear
from flashdsa.runtime.fp4 import scale_values
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP

logger = logging.getLogger(__name__)

FP8 = "F8_E4M3"
FP4 = ("I8", "U8", "F4")  # packed e2m1 pairs, as safetensors names their dtype
UE8M0 = ("F8_E8M0", "U8")  # power-of-two scales stored as their exponent byte


def scale_name(name: str, where: dict[str, Path]) -> str | None:
    """The checkpoint name of tensor ``name``'s scales (official ``<module>.scale`` or transformers'
    ``<name>_scale_inv``), None if it has none."""
    for candidate in (name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None,
                      name + "_scale_inv"):
        if candidate in where:
            return candidate
    return None


def keep_quantized(model: nn.Module, kinds: dict[str, str], where: dict[str, Path], expert_names: list[str],
                   own_name: Callable[[str], str | None]) -> None:
    """Swap ``model``'s modules (on the meta device) for ones holding the checkpoint's FP8 / FP4 bytes.
    ``kinds``: checkpoint name -> safetensors dtype; ``expert_names``: the official per-expert
    tensors; ``own_name``: checkpoint name -> the model's tensor name (None: not the model's)."""
    config: DeepseekV4Config = model.config
    pow2 = (config.quantization_config or {}).get("scale_fmt") == "ue8m0"
    experts = _expert_format(kinds, where, expert_names, config)
    if experts is not None:
        c = config
        for layer in [*model.model.layers, *model.mtp]:
            layer.mlp.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.swiglu_limit,
                                        fp8=experts == "fp8", pow2_scales=pow2,
                                        fp4_scales=None if experts == "fp8" else experts)
    experts_set = set(expert_names)
    for name, kind in kinds.items():
        own = own_name(name)
        if kind != FP8 or name in experts_set or own is None or scale_name(name, where) is None:
            continue
        parent_name, _, child = own.removesuffix(".weight").rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:  # a layer this model does not build (the MTP layer when not loaded)
            continue
        old = getattr(parent, child, None)
        if isinstance(old, GroupedLinear):
            out_per_group = old.weight.shape[0] // old.groups
            if out_per_group % GROUP:
                logger.info("%s stays dequantized: its groups of %d rows are not whole 128-row scale blocks",
                            own, out_per_group)
                continue
            new = FP8GroupedLinear(old.weight.shape[1], out_per_group, old.groups, True, pow2)
        elif isinstance(old, nn.Linear):
            new = FP8Linear(old.in_features, old.out_features, True, pow2)
        else:
            continue
        setattr(parent, child, new)


def _expert_format(kinds: dict[str, str], where: dict[str, Path], expert_names: list[str],
                   config: DeepseekV4Config) -> str | torch.dtype | None:
    """"fp8", the FP4 scale dtype (uint8: UE8M0 exponents, or float32), or None (dequantized)."""
    if not expert_names:
        return None
    first = expert_names[0]
    kind, scale = kinds[first], scale_name(first, where)
    if kind == FP8:
        if config.moe_intermediate_size % GROUP:
            logger.info("FP8 experts dequantized: moe_intermediate_size %d is not a multiple of %d",
                        config.moe_intermediate_size, GROUP)
            return None
        return "fp8"
    if kind in FP4 and scale is not None:
        return torch.uint8 if kinds[scale] in UE8M0 else torch.float32
    return None


def read_quantized(f, name: str, where: dict[str, Path], dest: torch.Tensor,
                   dest_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor ``name`` of the open file ``f`` as stored (e4m3, or packed FP4 as uint8) and its scales
    in ``dest_scale``'s dtype, for a destination ``dest`` of that format; ValueError if it is not."""
    kind, scale = f.get_slice(name).get_dtype(), scale_name(name, where)
    fp8 = dest.dtype == E4M3
    if scale is None or (kind != FP8 if fp8 else kind not in FP4):
        raise ValueError(f"{name}: the model keeps it {'e4m3' if fp8 else 'packed FP4'} (as the checkpoint's other "
                         f"tensors of its kind), so it must be {'e4m3' if fp8 else 'FP4'} with scales, got {kind}"
                         f"{'' if scale else ' without scales'}")
    with safe_open(where[scale], framework="pt") as g:
        s = g.get_tensor(scale)
    if s.dtype == torch.float8_e8m0fnu and dest_scale.dtype == torch.uint8:
        s = s.view(torch.uint8)
    elif dest_scale.dtype != torch.uint8:
        s = scale_values(s)
    return f.get_tensor(name).view(torch.uint8 if not fp8 else E4M3), s.to(dest_scale.dtype)
