"""Block allocator for the paged caches and the position -> slot mapping.

The allocator only hands out block ids and counts references; a sequence's block table is a
plain ``list[int]`` owned by the engine. Sharing a block (prefix caching, forked sequences) is
``incref``; each owner calls ``free`` once and the block returns to the pool at refcount 0.
Prefix hashing and eviction policy live above this class.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence, Union

import torch

from flashdsa.runtime.cache.layout import BLOCK_SIZE


class OutOfBlocks(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when every block is in use."""


class BlockAllocator:
    """Reference-counted pool of ``num_blocks`` block ids ``0 .. num_blocks - 1``.

    Free blocks are reused oldest-freed first, so a block freed just now stays intact the
    longest (useful to a prefix cache that may revive it).
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def _check_block(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in [0, {self.num_blocks}), got {block!r}")

    def refcount(self, block: int) -> int:
        """Number of owners of ``block`` (0 when free)."""
        self._check_block(block)
        return self._refcounts[block]

    def allocate(self) -> int:
        """Take a free block; its refcount becomes 1. Raises :class:`OutOfBlocks` when none is free."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} cache blocks are in use")
        block = self._free.popleft()
        self._refcounts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add an owner to an allocated ``block`` (sharing it)."""
        self._check_block(block)
        if self._refcounts[block] == 0:
            raise ValueError(f"cannot incref block {block}: it is not allocated")
        self._refcounts[block] += 1

    def free(self, block: int) -> bool:
        """Drop one owner of ``block``; returns True when that was the last and the block is free again."""
        self._check_block(block)
        if self._refcounts[block] == 0:
            raise ValueError(f"cannot free block {block}: it is not allocated (double free?)")
        self._refcounts[block] -= 1
        if self._refcounts[block]:
            return False
        self._free.append(block)
        return True


def slot_mapping(
    block_table: Union[Sequence[int], torch.Tensor],
    positions: Union[Sequence[int], torch.Tensor],
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Cache slots of ``positions`` in one sequence: ``block_table[p // block_size] * block_size + p % block_size``.

    block_table: the sequence's physical block ids (list or 1-D int tensor).
    positions: ``[T]`` token positions (list or 1-D int tensor).
    Returns ``[T]`` int64 on ``positions``' device (CPU for lists).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    positions = torch.as_tensor(positions, dtype=torch.int64)
    table = torch.as_tensor(block_table, dtype=torch.int64, device=positions.device)
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D [T], got shape {list(positions.shape)}")
    if table.dim() != 1:
        raise ValueError(f"block_table must be 1-D [num_blocks], got shape {list(table.shape)}")
    if positions.numel() == 0:
        return positions.clone()
    block_idx = positions.div(block_size, rounding_mode="floor")
    lo, hi = int(positions.min()), int(block_idx.max())
    if lo < 0 or hi >= table.numel():
        raise ValueError(
            f"positions must lie in [0, {table.numel() * block_size}) for a block_table of "
            f"{table.numel()} blocks of {block_size}, got positions in [{lo}, {int(positions.max())}]"
        )
    blocks = table[block_idx]
    if int(blocks.min()) < 0:
        unassigned = positions[blocks < 0].tolist()
        raise ValueError(f"block_table has a negative (unassigned) block for positions {unassigned}")
    return blocks * block_size + positions % block_size
