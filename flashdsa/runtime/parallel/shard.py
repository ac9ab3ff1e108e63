"""What one rank holds of a tensor/expert-parallel model, and the collectives that join the ranks.

A :class:`Shard` is handed to the model's constructor: sizes are divided by it (heads, MLP and
expert widths, the vocabulary, or the experts themselves under expert parallelism) and the
layers that produce partial sums reduce through it. ``Shard()`` is the single-process model: every
split is the identity and every collective a no-op, so the one model code serves both. The
collectives are torch.distributed's (NCCL on GPUs, gloo on CPU) and read nothing back to the host,
so a decode step stays capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelConfig:
    """The user's choice: ``tensor_parallel_size`` ranks (one per GPU); with
    ``enable_expert_parallel`` the routed experts are split over those ranks instead of each
    expert's width (vLLM's ``--enable-expert-parallel``)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks. ``group`` runs the model's collectives
    (None: the default group); ``cpu_group`` (gloo) carries rank 0's step inputs to the others."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    group: Optional[Any] = None
    cpu_group: Optional[Any] = None

    @classmethod
    def planned(cls, parallel: ParallelConfig, rank: int = 0) -> "Shard":
        """The shard of ``rank`` without any process group (planning, meta-device models)."""
        return cls(rank, parallel.tensor_parallel_size, parallel.enable_expert_parallel)

    def split(self, total: int, what: str) -> int:
        """This rank's part of ``total`` (heads, widths, vocabulary); ValueError if it does not divide."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} must divide {what} ({total})")
        return total // self.size

    def range(self, total: int, what: str) -> tuple[int, int]:
        """``[start, stop)`` of this rank's part of ``total``."""
        part = self.split(total, what)
        return self.rank * part, (self.rank + 1) * part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (in place; ``x`` returned)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., n]`` of every rank, concatenated in rank order on the last dim: ``[..., size * n]``."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
