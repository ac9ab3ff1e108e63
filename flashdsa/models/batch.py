"""Build ``BatchMetadata`` for single-shot runs (generate, check, tests) without the engine.

Each sequence owns the blocks in its row of ``block_tables``; a step appends ``new_tokens[b]``
tokens to sequence b, which already holds ``cached[b]`` tokens in the cache.
"""

from __future__ import annotations

import torch

from flashdsa.runtime.cache.layout import BLOCK_SIZE
from flashdsa.runtime.metadata import BatchMetadata


def contiguous_block_tables(max_tokens: list[int], block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Give sequence b the next ``ceil(max_tokens[b] / block_size)`` blocks: ``[B, max_blocks]`` int32, -1 pad."""
    counts = [-(-n // block_size) for n in max_tokens]
    table = torch.full((len(counts), max(counts)), -1, dtype=torch.int32)
    first = 0
    for b, n in enumerate(counts):
        table[b, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    return table


def step_metadata(
    cached: list[int],
    new_tokens: list[int],
    block_tables: torch.Tensor,
    all_logits: bool = False,
    device: torch.device | str = "cpu",
) -> BatchMetadata:
    """Metadata for one forward that appends ``new_tokens[b]`` tokens after ``cached[b]`` ones.

    Logits come for each sequence's last token, or for every token with ``all_logits``."""
    total = sum(new_tokens)
    last = torch.tensor(new_tokens).cumsum(0) - 1
    logits_indices = torch.arange(total) if all_logits else last
    return BatchMetadata.for_step(cached, new_tokens, block_tables, logits_indices).to(torch.device(device))
