"""Paged cache pools: one uint8 tensor per layer and cache kind, addressed by slot id.

A slot id is ``block_id * block_size + offset``; the engine maps token positions to slots with
:func:`flashdsa.runtime.cache.allocator.slot_mapping`. Pools start zeroed, so a slot read before
it is written dequantizes to zeros instead of garbage.
"""

from __future__ import annotations

import torch

from flashdsa.runtime.cache.layout import BLOCK_SIZE, INDEXER_TOKEN_BYTES, MLA_TOKEN_BYTES
from flashdsa.runtime.cache.layout_v4 import V4_TOKEN_BYTES


def _pool(num_blocks: int, block_size: int, token_bytes: int, device: torch.device | str) -> torch.Tensor:
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return torch.zeros(num_blocks, block_size, 1, token_bytes, dtype=torch.uint8, device=device)


def mla_pool(num_blocks: int, device: torch.device | str, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """MLA latent cache ``[num_blocks, block_size, 1, 656]`` uint8 (layout in ``layout.py``)."""
    return _pool(num_blocks, block_size, MLA_TOKEN_BYTES, device)


def indexer_pool(num_blocks: int, device: torch.device | str, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Indexer key cache ``[num_blocks, block_size, 1, 132]`` uint8 (per-block layout in ``layout.py``)."""
    return _pool(num_blocks, block_size, INDEXER_TOKEN_BYTES, device)


def v4_pool(num_blocks: int, device: torch.device | str, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """DeepSeek-V4 latent cache ``[num_blocks, block_size, 1, 584]`` uint8 (per-block MODEL1 layout
    in ``layout_v4.py``): the sliding window and the CSA / HCA compressed entries each use one."""
    return _pool(num_blocks, block_size, V4_TOKEN_BYTES, device)
