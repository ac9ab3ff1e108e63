"""Rank 0 drives the other ranks: it sends each step's inputs in one broadcast, they run the same step.

Rank 0 owns the scheduler, the block manager and the sampler; the other ranks own only their
part of the model and their copy of the caches. Messages go over the gloo ``cpu_group`` as
pickled CPU tensors (one broadcast a step): first the :class:`RunnerSpec` the model runner was
built with (the same caches and CUDA graphs on every rank), then one ``(input_ids, meta, decode)``
per step (a new RunnerSpec when rank 0 builds another engine on the model), then None to stop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flashdsa.runtime.parallel.shard import Shard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerSpec:
    """The arguments every rank builds its ModelRunner with."""

    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool


def send(shard: Shard, message: Any) -> None:
    """Rank 0: broadcast ``message`` (a RunnerSpec, a step, or None to stop) to the other ranks."""
    dist.broadcast_object_list([message], src=0, group=shard.cpu_group)


def receive(shard: Shard) -> Any:
    """Other ranks: the next message of rank 0."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=shard.cpu_group)
    return box[0]


def follow(model) -> None:
    """A worker rank's life after loading: build the runner each RunnerSpec of rank 0 describes (a
    new engine on the same model sends a new one, replacing the caches and graphs), run every step
    it sends."""
    from flashdsa.runtime.model_runner import ModelRunner

    runner = None
    while (message := receive(model.shard)) is not None:
        if isinstance(message, RunnerSpec):
            runner = None  # free the last engine's caches and graphs before allocating the next
            if model.device.type == "cuda":
                torch.cuda.empty_cache()
            runner = ModelRunner(model, message.num_blocks, model.device, message.max_num_seqs,
                                 message.max_model_len, message.enforce_eager)
        else:
            runner.execute(*message)
    logger.info("rank %d: stopped by rank 0", model.shard.rank)
