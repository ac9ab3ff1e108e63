"""Which slice of each checkpoint tensor a rank loads (vLLM's layout for DeepSeek models).

Column-parallel (rows split, dim 0): ``q_b_proj`` and ``kv_b_proj`` (whole heads, so each rank
holds ``heads / size`` of them), the gate and up projections of the dense MLPs, the shared expert
and (without expert parallelism) every routed expert, ``embed_tokens`` and ``lm_head`` (the
vocabulary). Row-parallel (columns split, dim 1): ``o_proj`` and the down projections; their
partial sums are all-reduced by the model. Everything else (the q/kv down-projections, norms,
router, the whole indexer) is replicated. Under expert parallelism the routed experts are not
split: rank r holds experts ``[r * E / size, (r + 1) * E / size)``, renumbered from 0.

FP8 weights are e4m3 with one fp32 scale per 128x128 block, so a split must fall on block
boundaries for the weight to stay FP8; :func:`check_fp8_splits` says so before any weight is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP
from flashdsa.runtime.parallel.shard import Shard

_COLUMN = re.compile(r"(self_attn\.(q_b_proj|kv_b_proj)|mlp\.(gate_proj|up_proj)|shared_experts\.(gate_proj|up_proj)"
                     r"|embed_tokens|lm_head)\.weight$")
_ROW = re.compile(r"(self_attn\.o_proj|mlp\.down_proj|shared_experts\.down_proj)\.weight$")
_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint tensor goes on this rank: the model's ``name`` for it and, when it is
    split, the ``[start, stop)`` range of dimension ``dim`` this rank reads."""

    name: str
    dim: Optional[int] = None
    start: int = 0
    stop: int = 0


def split_dim(name: str, expert_parallel: bool) -> Optional[int]:
    """The dimension tensor ``name`` is split on under tensor parallelism (None: replicated)."""
    expert = _EXPERT.match(name)
    if expert:
        return None if expert_parallel else (1 if expert.group(3) == "down_proj" else 0)
    if _COLUMN.search(name):
        return 0
    return 1 if _ROW.search(name) else None


def placement(name: str, shape: torch.Size, shard: Shard, num_experts: int) -> Optional[Placement]:
    """This rank's part of checkpoint tensor ``name`` of full ``shape``; None if another rank owns it."""
    expert = _EXPERT.match(name)
    if expert and shard.expert_parallel:
        start, stop = shard.range(num_experts, "n_routed_experts")
        e = int(expert.group(2))
        return Placement(f"{expert.group(1)}{e - start}.{expert.group(3)}.weight") if start <= e < stop else None
    dim = split_dim(name, shard.expert_parallel)
    if dim is None or shard.size == 1:
        return Placement(name)
    return Placement(name, dim, *shard.range(shape[dim], f"dimension {dim} of {name}"))


def check_fp8_splits(model: nn.Module, shard: Shard) -> None:
    """ValueError naming the first e4m3 weight whose per-rank part is not whole 128x128 blocks."""
    if shard.size == 1:
        return
    for name, t in model.state_dict().items():
        dim = split_dim(name, shard.expert_parallel)
        if t.dtype == E4M3 and dim is not None and t.shape[dim] % GROUP:
            side = "rows" if dim == 0 else "columns"
            raise ValueError(
                f"tensor_parallel_size {shard.size} splits {name} into {t.shape[dim]} {side} per rank; FP8 weights "
                f"split only on their {GROUP}x{GROUP} scale blocks (a multiple of {GROUP} per rank): use a smaller "
                f"tensor_parallel_size{' or --enable-expert-parallel' if _EXPERT.match(name) else ''}"
            )
