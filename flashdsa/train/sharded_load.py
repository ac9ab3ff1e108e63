"""The model to fine-tune, loaded on each rank as FSDP2 shards: no rank reads the whole checkpoint.

With several ranks (``torchrun``), a DeepSeek-V3.2 checkpoint is loaded this way: every rank
builds the model on the meta device, shards it with FSDP2 (:meth:`World.shard`), allocates only its
own shards (``to_empty`` on its device) and fills them by reading just its rows of each tensor
from the safetensors files (``flashdsa.models.loader.Checkpoint``, ``safe_open(...).get_slice``).
FSDP2 splits every parameter on dim 0 as ``torch.chunk`` does, so a rank reads at most
``ceil(rows / N)`` rows of a tensor (the last ranks fewer, or none), an FP8 weight with the rows of
its block scales that cover them, dequantized to fp32 element by element exactly as the
one-process load does. The routed experts are stacked in the model (``[E, 2I, H]``, rows = experts)
and stored per expert, so a rank reads the whole checkpoint tensors of the experts in its rows and
none of the others. Buffers (the routers' correction bias, ``[E]``) are not sharded: every rank
reads them whole. So a rank holds its shards plus one tensor's rows in flight.

One process loads the whole model on its device, as does each rank for a DeepSeek-V4 checkpoint
(its loader reads whole tensors; the Trainer shards it afterwards).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.models.deepseek_v4_config import model_type
from flashdsa.models.linear import SCALE_SUFFIX
from flashdsa.models.loader import Checkpoint, check_complete, copy_weight
from flashdsa.models.moe import Experts
from flashdsa.runtime.parallel.sharding import Placement
from flashdsa.train.architecture import add_mtp_layer, load_trainable
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
    """The model's name for each checkpoint tensor (as its state dict names it: per expert for the
    stacked experts, by their own ``Experts.slices``) -> its slot."""
    out = {name: Slot(name) for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    for path, module in model.named_modules():
        if isinstance(module, Experts):
            for suffix, (stacked, expert, rows) in module.slices.items():
                if not suffix.endswith(SCALE_SUFFIX):
                    out.pop(f"{path}.{stacked}", None)
                    out[f"{path}.{suffix}"] = Slot(f"{path}.{stacked}", expert, rows)
    return out


@torch.no_grad()
def load_shards(path: str | Path, world: World, fresh_mtp: bool = False) -> DeepseekV32ForCausalLM:
    """This rank's FSDP2 shards of the fp32 DeepSeek-V3.2 model of checkpoint ``path`` (with its
    MTP layer when it has one; with ``fresh_mtp`` an uninitialised new one), on ``world.device``.
    Raises ValueError naming every missing, unexpected or mis-shaped tensor (checked on the
    tensors' headers, before their rows are read)."""
    path = Path(path)
    config = DeepseekV32Config.from_json(path)
    mtp = config.num_nextn_predict_layers > 0
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, "reference")
        if mtp or fresh_mtp:
            add_mtp_layer(model)
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}  # the checkpoint's names
    targets = slots(model)
    world.shard(model)
    model.to_empty(device=world.device)
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    checkpoint = Checkpoint(path, config)
    loaded, unexpected, misshaped = set(), [], []
    for f, name, own in checkpoint.weights(mtp, progress=world.is_main):
        shape = list(f.get_slice(name).get_shape())
        if own not in targets:
            unexpected.append(name)
            continue
        if shape != shapes[own]:
            misshaped.append(f"{own}: expected {shapes[own]}, got {shape}")
            continue
        slot = targets[own]
        local, start, stop = own_rows(tensors[slot.tensor])
        if slot.expert is None and stop > start:
            t, scale = checkpoint.read(f, name, Placement(own, 0, start, stop))
            copy_weight(local, None, t, scale, checkpoint.block)
        elif slot.expert is not None and start <= slot.expert < stop:  # else another rank's expert
            t, scale = checkpoint.read(f, name, Placement(own))
            copy_weight(local[slot.expert - start, slot.rows], None, t, scale, checkpoint.block)
        loaded.add(own)
    fresh = {name for name in shapes if fresh_mtp and name.startswith("model.mtp.")}
    check_complete(path, set(shapes) - fresh, loaded, unexpected, misshaped)
    return model.eval()


def load_for_training(path: str | Path, world: World, fresh_mtp_seed: Optional[int] = None) -> nn.Module:
    """The fp32 model of checkpoint ``path`` (either architecture, with its MTP layer when it has
    one) to train on ``world``: whole on the device of one process; this rank's FSDP2 shards of a
    DeepSeek-V3.2 model (:func:`load_shards`); a DeepSeek-V4 model whole on the host of each rank,
    for the Trainer to shard. With ``fresh_mtp_seed`` the model gets a new MTP layer, initialised
    with that seed (sharded: each rank keeps its rows of the one-process values)."""
    fresh = fresh_mtp_seed is not None
    if world.size > 1 and model_type(path) != "deepseek_v4":
        model = load_shards(path, world, fresh)
        layer = model.model.mtp if fresh else None
    else:
        model = load_trainable(Path(path), world.device if world.size == 1 else torch.device("cpu"))
        layer = add_mtp_layer(model) if fresh else None
    if layer is not None:
        initialize(layer, seed=fresh_mtp_seed, depth=model.config.num_hidden_layers)
    return model
