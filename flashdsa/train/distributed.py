"""Data-parallel fine-tuning over several processes: FSDP2 sharding, each rank a slice of every batch.

Under ``torchrun --nproc-per-node N -m flashdsa finetune ...`` every rank holds 1/N of each
parameter, gradient and optimizer state (``torch.distributed.fsdp.fully_shard``, per decoder layer
then the root) and trains on rows ``[rank * B/N, (rank + 1) * B/N)`` of every global batch of B
rows, so the global batch, the mean loss and the gradient (FSDP averages it over ranks) are the
one-process run's. Checkpoints keep one layout whatever the rank count, so a run resumes on any
number of ranks, and no host holds the whole model or optimizer state: rank 0 writes the HF-layout
weights gathered one tensor at a time (``weight_stream``), every rank writes its shards of the
optimizer state (torch.distributed.checkpoint, which reshards on load). NCCL on GPUs (one per
rank), gloo on CPU.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from flashdsa.train.architecture import forwards
from flashdsa.train.forward import SHARDED_FORWARD

logger = logging.getLogger(__name__)


class World:
    """This process's place in the run: rank ``rank`` of ``size`` (size 1: one process, no group)."""

    def __init__(self, rank: int = 0, size: int = 1, device: torch.device = torch.device("cpu")):
        self.rank, self.size, self.device = rank, size, torch.device(device)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes checkpoints, the log and the plot."""
        return self.rank == 0

    def check_batch(self, batch_size: int) -> None:
        """ValueError unless ``batch_size`` rows split evenly over the ranks."""
        if batch_size % self.size:
            raise ValueError(f"the batch of {batch_size} sequences does not split over {self.size} ranks: "
                             f"make --batch-tokens / --seq-len a multiple of {self.size}")

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global ``batch: [B, L + 1]`` (B divisible by the size)."""
        rows = batch.shape[0] // self.size
        return batch[self.rank * rows : (self.rank + 1) * rows]

    def shard(self, model) -> None:
        """FSDP2 over every rank: each decoder layer, then the root (embedding, final norm, head);
        parameters move to this rank's device (a model on the meta device stays there until
        ``to_empty``). One process, or a model sharded already: nothing to do."""
        if self.size == 1 or isinstance(model, FSDPModule):
            return
        mesh = init_device_mesh(self.device.type, (self.size,))
        _, model_forward, layer_forward = forwards(model)
        for module, forward in [(layer, layer_forward) for layer in model.model.layers] + [(model, model_forward)]:
            fully_shard(module, mesh=mesh)
            setattr(module, SHARDED_FORWARD, partial(forward, module))
            register_fsdp_forward_method(module, SHARDED_FORWARD)

    def mean(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """Each scalar averaged over the ranks (the global batch's value), as floats."""
        stacked = torch.stack([v.detach().float().reshape(()) for v in values.values()])
        if self.size > 1:
            dist.all_reduce(stacked)
            stacked /= self.size
        return dict(zip(values, stacked.tolist()))

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any (so all ranks take the same branch)."""
        if self.size == 1:
            return flag
        box = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return bool(box.item())

    def save_optimizer(self, model, optimizer, path: Path) -> None:
        """Write the optimizer's state to directory ``path`` with torch.distributed.checkpoint: each
        rank its own shards, under the parameters' module paths, so :meth:`load_optimizer` reads it
        back on any number of ranks. Collective."""
        _reshard(model)
        with _quiet_alone():
            dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=path, no_dist=self.size == 1)

    def load_optimizer(self, model, optimizer, source: Path | dict) -> None:
        """Load the optimizer state that :meth:`save_optimizer` wrote to directory ``source``, each
        rank reading the rows of its shards whatever the rank count of the save; or ``source`` the
        full state by parameter name that checkpoints held before (every rank cuts its rows)."""
        _reshard(model)
        if isinstance(source, dict):
            set_optimizer_state_dict(model, optimizer, source, options=StateDictOptions(full_state_dict=True))
            return
        state = get_optimizer_state_dict(model, optimizer)  # the layout to read into
        with _quiet_alone():
            dcp.load(state, checkpoint_id=source, no_dist=self.size == 1)
        set_optimizer_state_dict(model, optimizer, state)

    @torch.no_grad()
    def load_model_state(self, model, source: nn.Module) -> None:
        """Copy the weights of ``source`` (the same architecture, whole or FSDP2-sharded) into
        ``model``: each rank its own rows, read from the rows ``source`` holds here."""
        _reshard(model)
        theirs = dict([*source.named_parameters(), *source.named_buffers()])
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            local, start, stop = own_rows(tensor)
            held, first, _ = own_rows(theirs[name])
            local.copy_(held[start - first : stop - first])

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


@contextmanager
def _quiet_alone() -> Iterator[None]:
    """A block where torch.distributed.checkpoint does not warn that one process (no process group)
    saves or loads in a single process: that is this run's intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _reshard(model) -> None:
    """Put every FSDP module back on its shards: the root keeps its gathered parameters after a
    forward without backward (an evaluation), and those are not the optimizer's."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def own_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(local, start, stop)``: the rows ``[start, stop)`` of ``tensor``'s full dim 0 this rank
    holds, and the tensor holding them (FSDP2 shards dim 0 as ``torch.chunk`` does, so the last
    ranks may hold fewer rows or none; a tensor that is not a DTensor is whole on every rank)."""
    if not isinstance(tensor, DTensor):
        return tensor, 0, tensor.shape[0]
    if tuple(tensor.placements) != (Shard(0),):
        raise ValueError(f"expected a DTensor sharded on dim 0 over one mesh dimension, got {tensor.placements}")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"local shard {list(local.shape)} is not the {list(shape)} DTensor computes")
    return local, offset[0], offset[0] + shape[0]


def row_ranges(rows: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of the dim-0 rows each of ``size`` ranks holds of a tensor of ``rows`` rows
    under FSDP2 (``torch.chunk``'s split: the last ranks may hold fewer, or none)."""
    chunk = -(-rows // size)
    return [(min(rows, r * chunk), min(rows, (r + 1) * chunk)) for r in range(size)]


def full_norm(norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s total norm as a float (under FSDP a DTensor partial over the ranks)."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def join(device: torch.device) -> World:
    """The World of this process: from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), it
    joins the process group (NCCL on CUDA, one GPU per local rank; gloo on CPU); else one process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(device=device)
    rank = int(os.environ["RANK"])
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ValueError(f"rank {rank}: local rank {local} needs GPU {local}, {torch.cuda.device_count()} visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, timeout=timedelta(minutes=30), device_id=device if backend == "nccl" else None)
    except Exception as exc:
        raise RuntimeError(f"rank {rank}: {backend.upper()} failed to initialize: {exc}") from exc
    logger.info("rank %d of %d on %s (%s)", rank, size, device, backend)
    return World(rank, size, device)


def leave(world: World) -> None:
    """Leave the process group (after rank 0's last write)."""
    if world.size > 1 and dist.is_initialized():
        world.barrier()
        dist.destroy_process_group()
