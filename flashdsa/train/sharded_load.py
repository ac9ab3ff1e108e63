"""The model to fine-tune, loaded on each rank as FSDP2 shards: no rank reads the whole checkpoint.

With several ranks (``torchrun``), a checkpoint of either architecture is loaded this way: every
rank builds the model on the meta device, shards it with FSDP2 (:meth:`World.shard`), allocates
only its own shards (``to_empty`` on its device) and fills them by reading just its rows of each
tensor from the safetensors files (``safe_open(...).get_slice``), through its architecture's own
loader (DeepSeek-V3.2: ``flashdsa.models.loader.Checkpoint``; DeepSeek-V4, official or
transformers layout, the release's formats included: ``deepseek_v4_loader.V4Checkpoint``).
FSDP2 splits every parameter on dim 0 as ``torch.chunk`` does, so a rank reads at most
``ceil(rows / N)`` rows of a tensor (the last ranks fewer, or none); an FP8 weight with the rows of
its 128x128 block scales that cover them, an FP4 one with the same rows of its per-32-input
scales, dequantized to fp32 element by element exactly as the one-process load does. The routed
experts are stacked in the model (``[E, 2I, H]``, rows = experts) and stored per expert, so a
rank reads the whole checkpoint tensors of the experts in its rows and none of the others (a
stacked checkpoint tensor, transformers' V4 layout: its rows of experts). Buffers (the routers'
correction bias ``[E]``, V4's hash-routing table ``tid2eid``) are not sharded: every rank reads
them whole. So a rank holds its shards plus one tensor's rows in flight.

One process loads the whole model on its device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from flashdsa.models import deepseek_v4_loader as v4_loader
from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.models.deepseek_v4 import DeepseekV4ForCausalLM
from flashdsa.models.deepseek_v4_config import DeepseekV4Config, model_type
from flashdsa.models.linear import SCALE_SUFFIX
from flashdsa.models.loader import Checkpoint, check_complete, dequantize_blocks
from flashdsa.models.moe import Experts
from flashdsa.runtime.parallel.sharding import Placement
from flashdsa.train.architecture import add_mtp_layer, load_trainable, mtp_layer
from flashdsa.train.distributed import World, own_rows
from flashdsa.train.init import initialize


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor goes: the model tensor ``tensor`` (its module path) whole, or,
    for a routed expert's weight, rows ``rows`` of expert ``expert`` of that stacked tensor."""

    tensor: str
    expert: Optional[int] = None
    rows: slice = field(default_factory=lambda: slice(None))


def slots(model: nn.Module) -> dict[str, Slot]:
    """The DeepSeek-V3.2 model's name for each checkpoint tensor (as its state dict names it: per
    expert for the stacked experts, by their own ``Experts.slices``) -> its slot."""
    out = {name: Slot(name) for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    for path, module in model.named_modules():
        if isinstance(module, Experts):
            for suffix, (stacked, expert, rows) in module.slices.items():
                if not suffix.endswith(SCALE_SUFFIX):
                    out.pop(f"{path}.{stacked}", None)
                    out[f"{path}.{suffix}"] = Slot(f"{path}.{stacked}", expert, rows)
    return out


def v4_slots(model: nn.Module) -> dict[str, Slot]:
    """The DeepSeek-V4 model's tensors and each piece of its stacked experts (``v4_loader.pieces``:
    one per official per-expert tensor, ``w1`` / ``w3`` the halves of ``gate_up_proj``) -> its slot."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = Slot(name)
        for key, (expert, half) in v4_loader.pieces(name, t.shape).items():
            if expert is not None:
                n = t.shape[1] // 2  # rows of each half of gate_up_proj
                out[key] = Slot(name, expert, slice(None) if half is None else slice(half * n, (half + 1) * n))
    return out


@dataclass
class _Source:
    """A checkpoint as :func:`load_shards` walks it, for the meta ``model`` it fills."""

    model: nn.Module
    slots: dict[str, Slot]  # the model's name for a checkpoint tensor (a key) -> its slot
    expected: set[str]  # the keys that must be loaded
    weights: Iterable[tuple[Any, str, Optional[str]]]  # (open file, checkpoint name, key or None: not the model's)
    shape: Callable[[Any, str], list[int]]  # a checkpoint tensor's shape as read, from its header
    read: Callable[[Any, str, slice], torch.Tensor]  # rows [start, stop) of a checkpoint tensor, as float
    covers: Callable[[str], set[str]]  # a loaded key -> the expected keys it fills
    architecture: str


def _v32_source(path: Path, fresh_mtp: bool, progress: bool) -> _Source:
    """A DeepSeek-V3.2 checkpoint (``loader.Checkpoint``): FP8 weights cut inside a 128-row scale
    block come dequantized, on whole blocks as e4m3 with their scale rows (dequantized here)."""
    config = DeepseekV32Config.from_json(path)
    mtp = config.num_nextn_predict_layers > 0
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, "reference")
        if mtp or fresh_mtp:
            add_mtp_layer(model)
    checkpoint = Checkpoint(path, config)

    def read(f, name: str, rows: slice) -> torch.Tensor:
        t, scale = checkpoint.read(f, name, Placement(name, 0, rows.start, rows.stop))
        return t if scale is None else dequantize_blocks(t, scale, checkpoint.block, (rows.start, 0))
    targets = slots(model)
    expected = {key for key in targets if not (fresh_mtp and key.startswith("model.mtp."))}
    return _Source(model, targets, expected, checkpoint.weights(mtp, progress),
                   lambda f, name: list(f.get_slice(name).get_shape()), read, lambda key: {key}, "DeepSeek-V3.2")


def _v4_source(path: Path, fresh_mtp: bool, progress: bool) -> _Source:
    """A DeepSeek-V4 checkpoint (``deepseek_v4_loader.V4Checkpoint``), official or transformers
    layout; its keys are ``deepseek_v4_loader.piece`` names (a stacked tensor read whole covers all
    of its experts' pieces)."""
    config = DeepseekV4Config.from_json(path)
    mtp = config.num_nextn_predict_layers
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, torch.float32, mtp)
        if fresh_mtp:
            add_mtp_layer(model)
    checkpoint = v4_loader.V4Checkpoint(path)
    shapes = {name: t.shape for name, t in [*model.named_parameters(), *model.named_buffers()]}
    expected = {key for name, shape in shapes.items() if not (fresh_mtp and name.startswith("mtp."))
                for key in v4_loader.pieces(name, shape)}
    weights = ((f, name, None if target is None else v4_loader.piece(*target))
               for f, name, target in checkpoint.weights(set(shapes), mtp > 0, progress))

    def covers(key: str) -> set[str]:
        return set(v4_loader.pieces(key, shapes[key])) if key in shapes else {key}
    return _Source(model, v4_slots(model), expected, weights, checkpoint.shape, checkpoint.read, covers, "DeepSeek-V4")


def _shape(whole: torch.Size, slot: Slot) -> list[int]:
    """The shape of the checkpoint tensor ``slot`` of a model tensor of shape ``whole`` takes."""
    if slot.expert is None:
        return list(whole)
    return list(torch.empty(whole, device="meta")[slot.expert][slot.rows].shape)


@torch.no_grad()
def load_shards(path: str | Path, world: World, fresh_mtp: bool = False) -> nn.Module:
    """This rank's FSDP2 shards of the fp32 model (DeepSeek-V3.2 or V4, by ``model_type``) of
    checkpoint ``path`` (with its MTP layer when it has one; with ``fresh_mtp`` an uninitialised
    new one), on ``world.device``. Raises ValueError naming every missing, unexpected or
    mis-shaped tensor (checked on the tensors' headers, before their rows are read)."""
    path = Path(path)
    source = (_v4_source if model_type(path) == "deepseek_v4" else _v32_source)(path, fresh_mtp, world.is_main)
    model = source.model
    shapes = {name: t.shape for name, t in [*model.named_parameters(), *model.named_buffers()]}
    world.shard(model)
    model.to_empty(device=world.device)
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    loaded, unexpected, misshaped = set(), [], []
    for f, name, key in source.weights:
        slot = source.slots.get(key)
        if slot is None:
            unexpected.append(name)
            continue
        shape, expected = source.shape(f, name), _shape(shapes[slot.tensor], slot)
        if shape != expected:
            misshaped.append(f"{key}: expected {expected}, got {shape}")
            continue
        local, start, stop = own_rows(tensors[slot.tensor])
        if slot.expert is None and stop > start:
            local.copy_(source.read(f, name, slice(start, stop)))
        elif slot.expert is not None and start <= slot.expert < stop:  # else another rank's expert
            local[slot.expert - start, slot.rows].copy_(source.read(f, name, slice(0, shape[0])))
        loaded |= source.covers(key)
    check_complete(path, source.expected, loaded, unexpected, misshaped, source.architecture)
    return model.eval()


def load_for_training(path: str | Path, world: World, fresh_mtp_seed: Optional[int] = None) -> nn.Module:
    """The fp32 model of checkpoint ``path`` (either architecture, with its MTP layer when it has
    one) to train on ``world``: whole on the device of one process; this rank's FSDP2 shards on
    several (:func:`load_shards`). With ``fresh_mtp_seed`` the model gets a new MTP layer,
    initialised with that seed (sharded: each rank keeps its rows of the one-process values)."""
    fresh = fresh_mtp_seed is not None
    if world.size > 1:
        model = load_shards(path, world, fresh)
        layer = mtp_layer(model) if fresh else None
    else:
        model = load_trainable(Path(path), world.device)
        layer = add_mtp_layer(model) if fresh else None
    if layer is not None:
        initialize(layer, seed=fresh_mtp_seed, depth=model.config.num_hidden_layers)
    return model
