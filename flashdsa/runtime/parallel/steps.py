"""Rank 0 drives the other ranks: it sends each step's inputs in one broadcast, they run the same step.

Rank 0 owns the scheduler, the block manager and the sampler; the other ranks own only their
part of the model and their copy of the caches. Messages go over the gloo ``cpu_group``, pickled
(a step's tensors as NumPy arrays; one broadcast a step): first the :class:`RunnerSpec` the model runner was
built with (the same caches and CUDA graphs on every rank), then one :class:`Step` per step (a
new RunnerSpec when rank 0 builds another engine on the model), then None to stop.

Under async scheduling a step's last input ids are the tokens rank 0 sampled in the step still
running, which only rank 0's device holds (``transfer.TokenFill``). The step message then carries
the fill's host indices, and the tokens themselves follow over the device group (NCCL on GPUs):
one broadcast queued on the stream, which no host waits for.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from flashdsa.runtime.parallel.shard import Shard
from flashdsa.runtime.transfer import TokenFill

logger = logging.getLogger(__name__)
STEP_TIMES_KEPT = 4096  # a worker's step-time log covers its runner's last this many graph steps


@dataclass(frozen=True)
class RunnerSpec:
    """The arguments every rank builds its ModelRunner with."""

    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool


@dataclass(frozen=True)
class Step:
    """One step's host inputs (``ModelRunner.execute``'s arguments; ``decode``: rank 0 replays a
    decode graph, so the others do too) and, under async scheduling,
    its ``TokenFill`` without the device tensor: ``fill_numel`` int64 tokens (0: no fill) that
    rank 0 broadcasts right after this message."""

    input_ids: torch.Tensor
    meta: Any
    decode: bool
    fill_numel: int = 0
    fill_ids: tuple[int, ...] = ()

    def __reduce__(self):
        """Pickled with NumPy arrays in place of the tensors: ten times cheaper both ways at batch 128."""
        fields = {name: _to_numpy(value) for name, value in vars(self.meta).items()}
        return _rebuild_step, (_to_numpy(self.input_ids), type(self.meta), fields, self.decode, self.fill_numel,
                               self.fill_ids)


def _to_numpy(value: Any) -> Any:
    return value.numpy() if isinstance(value, torch.Tensor) else value


def _to_tensor(value: Any) -> Any:
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def _rebuild_step(input_ids: np.ndarray, meta_type: type, fields: dict, decode: bool, fill_numel: int,
                  fill_ids: tuple[int, ...]) -> Step:
    meta = meta_type(**{name: _to_tensor(value) for name, value in fields.items()})
    return Step(torch.from_numpy(input_ids), meta, decode, fill_numel, fill_ids)


def send(shard: Shard, message: Any) -> None:
    """Rank 0: broadcast ``message`` (a RunnerSpec, a step, or None to stop) to the other ranks."""
    dist.broadcast_object_list([message], src=0, group=shard.cpu_group)


def send_step(shard: Shard, input_ids: torch.Tensor, meta: Any, decode: bool, fill: Optional[TokenFill]) -> None:
    """Rank 0: send a step, then the device tokens its ``fill`` takes (stream-ordered, no host wait)."""
    if fill is None:
        send(shard, Step(input_ids, meta, decode))
        return
    if fill.moves is not None:
        raise ValueError("tensor-parallel steps do not move sequences on the device (speculative decoding is one GPU)")
    send(shard, Step(input_ids, meta, decode, fill.source.numel(), tuple(fill.ids)))
    dist.broadcast(fill.source.contiguous(), src=0)


def _receive_fill(step: Step, device: torch.device) -> Optional[TokenFill]:
    """A worker's copy of rank 0's fill for ``step`` (its tokens arrive over the device group)."""
    if not step.fill_numel:
        return None
    source = torch.empty(step.fill_numel, dtype=torch.int64, device=device)
    dist.broadcast(source, src=0)
    return TokenFill(source, list(step.fill_ids))


def receive(shard: Shard) -> Any:
    """Other ranks: the next message of rank 0."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=shard.cpu_group)
    return box[0]


def follow(model) -> None:
    """A worker rank's life after loading: build the runner each RunnerSpec of rank 0 describes (a
    new engine on the same model sends a new one, replacing the caches and graphs), run every step
    it sends. When a runner is replaced or stopped, logs its last decode-graph steps' host time:
    waiting for rank 0's message, and queueing the step (tells a lagging worker from a waiting one)."""
    from flashdsa.runtime.model_runner import ModelRunner

    runner, waits, runs = None, deque(maxlen=STEP_TIMES_KEPT), deque(maxlen=STEP_TIMES_KEPT)
    while True:
        start = time.perf_counter()
        message = receive(model.shard)
        received = time.perf_counter()
        if message is None or isinstance(message, RunnerSpec):
            _log_step_times(model.shard.rank, waits, runs)
            waits.clear()
            runs.clear()
        if message is None:
            logger.info("rank %d: stopped by rank 0", model.shard.rank)
            return
        if isinstance(message, RunnerSpec):
            runner = None  # free the last engine's caches and graphs before allocating the next
            if model.device.type == "cuda":
                torch.cuda.empty_cache()
            runner = ModelRunner(model, message.num_blocks, model.device, message.max_num_seqs,
                                 message.max_model_len, message.enforce_eager)
        else:
            runner.execute(message.input_ids, message.meta, message.decode, _receive_fill(message, model.device))
            if message.decode:
                waits.append(received - start)
                runs.append(time.perf_counter() - received)


def _log_step_times(rank: int, waits: deque, runs: deque) -> None:
    if waits:
        logger.info("rank %d: %d graph steps, host ms a step (median): %.3f waiting for rank 0, %.3f queueing it",
                    rank, len(waits), statistics.median(waits) * 1e3, statistics.median(runs) * 1e3)
