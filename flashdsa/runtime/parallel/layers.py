"""Vocabulary-parallel embedding and LM head: each rank holds ``vocab / size`` rows.

Both keep the parameter name ``weight`` of ``nn.Embedding`` / ``nn.Linear``, so checkpoints load
and save unchanged; with ``Shard()`` they are those modules exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdsa.runtime.parallel.shard import Shard


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, stop)`` of the embedding; ids outside give zeros, summed over the ranks."""

    def __init__(self, vocab_size: int, dim: int, shard: Shard = Shard()):
        self.start, self.stop = shard.range(vocab_size, "vocab_size")
        super().__init__(self.stop - self.start, dim)
        self.shard = shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int64 (full vocabulary) -> [T, dim]."""
        if self.shard.size == 1:
            return super().forward(input_ids)
        mine = (input_ids >= self.start) & (input_ids < self.stop)
        local = torch.where(mine, input_ids - self.start, 0)
        return self.shard.all_reduce(super().forward(local) * mine[:, None].to(self.weight.dtype))


class ParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary rows, gathered over the ranks: ``[N, hidden] -> [N, vocab]``."""

    def __init__(self, hidden: int, vocab_size: int, shard: Shard = Shard()):
        super().__init__(hidden, shard.split(vocab_size, "vocab_size"), bias=False)
        self.shard = shard

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.shard.all_gather_last(F.linear(h, self.weight))
