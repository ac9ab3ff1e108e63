"""DeepSeek-V4's caches in the engine: paged compressed entries, and a state slot per running sequence.

Per layer (a sliding-window layer has only the window):
  window   ``[num_slots, W, ...]``: the last W = ``sliding_window`` raw K=V rows of each running
           sequence, position p in row ``p % W`` of its state slot (a ring).
  entries  paged ``[num_blocks, R, ...]`` (CSA / HCA): the compressed K=V entries, one per ``ratio``
           tokens, R = ``max(1, 64 // ratio)`` of them per 64-token block of the block table. Entry j
           lives in the block that holds its window's last token, ``((j + 1) * ratio - 1) // 64``,
           row ``j % R``: what a block holds depends only on the tokens up to its end.
  index    paged like ``entries`` (CSA): the lightning indexer's compressed keys.
  states   ``[num_slots, rows, C]`` fp32 each (``runtime.compressor.new_state``): the compressors'
           open (and, for CSA, last closed) windows, for the entries and for the index keys.
A state slot (window rows and states, every layer) is a sequence's whole state beyond its blocks:
copying one is a prefix-cache snapshot (``runtime.block_manager``).
Production pools are FlashMLA's MODEL1 (584 B per window row or entry, ``cache.layout_v4``) and the
V3.2 FP8 indexer layout (132 B per key); reference pools hold fp32 rows. The paged part is what a
64-token block costs (:func:`bytes_per_block`); window and states are fixed per slot
(:func:`bytes_per_slot`), so a sequence's cache grows at each layer type's own rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashdsa.models.deepseek_v4_config import DeepseekV4Config
from flashdsa.runtime.cache.layout import BLOCK_SIZE, INDEXER_TOKEN_BYTES
from flashdsa.runtime.cache.layout_v4 import V4_TOKEN_BYTES
from flashdsa.runtime.cache.pool import indexer_pool, v4_pool
from flashdsa.runtime.compressor import new_state

FP32 = 4


@dataclass
class V4LayerCache:
    """One layer's storage (module docstring); ``None`` where the layer type has none."""

    window: torch.Tensor
    entries: torch.Tensor | None = None
    index: torch.Tensor | None = None
    state: tuple[torch.Tensor, torch.Tensor] | None = None
    index_state: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class V4Caches:
    layers: list[V4LayerCache]

    block_size = BLOCK_SIZE  # tokens a block of the block table covers

    def copy_slots(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy whole state slots ``source[i] -> destination[i]`` (int64 ``[n]``): window rows and
        compressor states, every layer (prefix-cache snapshots and their restores)."""
        for cache in self.layers:
            for t in (cache.window, *(cache.state or ()), *(cache.index_state or ())):
                t[destination] = t[source]

    @property
    def num_blocks(self) -> int:
        paged = [c.entries for c in self.layers if c.entries is not None]
        return paged[0].shape[0] if paged else 0


def entries_per_block(ratio: int) -> int:
    """Compressed entries a 64-token block holds: ``64 // ratio``, at least 1."""
    if BLOCK_SIZE % ratio and ratio % BLOCK_SIZE:
        raise ValueError(f"compression ratio {ratio} must divide or be a multiple of the block size {BLOCK_SIZE}")
    return max(1, BLOCK_SIZE // ratio)


def entry_slot_table(block_tables: torch.Tensor, ratio: int, count: int | None = None) -> torch.Tensor:
    """Pool slot of compressed entries ``0 .. count - 1`` of the sequences whose blocks are the rows of
    ``block_tables: [B, max_blocks]`` -> ``[B, count + 1]`` int64, -1 where a block is missing and in
    the last column (what :func:`lookup_entries` reads for no entry). ``count`` defaults to every entry
    the tables' blocks can hold. A handful of device ops, no host sync: made once per step and ratio,
    it turns every later slot lookup of the step into one gather."""
    per_block, tables = entries_per_block(ratio), block_tables.long()
    if ratio < BLOCK_SIZE:  # entry j: block j // per_block, row j % per_block; a missing block (-1) gives -1
        rows = torch.arange(per_block, device=tables.device)
        slots = (tables[:, :, None] * per_block + rows).flatten(1).clamp_min(-1)
    else:  # entry j ends in block (j + 1) * step - 1, its only entry
        step = ratio // BLOCK_SIZE
        slots = tables[:, step - 1 :: step]
    count = slots.shape[1] if count is None else count
    return F.pad(slots[:, :count], (0, count + 1 - min(count, slots.shape[1])), value=-1)


def lookup_entries(table: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """Pool slots ``[R, n]`` int64 of entry ids ``entries: [R, n]`` (-1 or past the table: none -> -1)
    of the sequences ``rows: [R]`` of an :func:`entry_slot_table` ``[B, count + 1]``. No host sync."""
    count = table.shape[1] - 1
    return table[rows[:, None], entries.clamp(-1, count) % (count + 1)]


def entry_slots(entries: torch.Tensor, block_tables: torch.Tensor, ratio: int) -> torch.Tensor:
    """Pool slots of compressed entry ids ``entries: [B, n]`` (-1: none) of the sequences whose blocks
    are the rows of ``block_tables: [B, max_blocks]`` -> ``[B, n]`` int64, -1 kept. No host sync."""
    rows = torch.arange(entries.shape[0], device=entries.device)
    return lookup_entries(entry_slot_table(block_tables, ratio), rows, entries)


def _pool(production: bool, blocks: int, rows: int, width: int, token_bytes: int, device) -> torch.Tensor:
    if production:
        return (v4_pool if token_bytes == V4_TOKEN_BYTES else indexer_pool)(blocks, device, rows)
    return torch.zeros(blocks, rows, width, device=device)


def allocate_v4_caches(config: DeepseekV4Config, production: bool, num_blocks: int, num_slots: int,
                       device: torch.device) -> V4Caches:
    """Every layer's storage for ``num_blocks`` blocks and ``num_slots`` running sequences."""
    c, layers = config, []
    for ratio in c.compress_ratios:
        cache = V4LayerCache(_pool(production, num_slots, c.sliding_window, c.head_dim, V4_TOKEN_BYTES, device))
        if ratio:
            overlap = ratio == c.csa_ratio
            rows = entries_per_block(ratio)
            cache.entries = _pool(production, num_blocks, rows, c.head_dim, V4_TOKEN_BYTES, device)
            cache.state = new_state(num_slots, ratio, c.head_dim * (1 + overlap), overlap, device)
            if overlap:
                cache.index = _pool(production, num_blocks, rows, c.index_head_dim, INDEXER_TOKEN_BYTES, device)
                cache.index_state = new_state(num_slots, ratio, 2 * c.index_head_dim, True, device)
        layers.append(cache)
    return V4Caches(layers)


def bytes_per_block(config: DeepseekV4Config, production: bool) -> int:
    """Bytes the paged caches take per 64-token block, all layers."""
    total = 0
    for ratio in filter(None, config.compress_ratios):
        entry = V4_TOKEN_BYTES if production else FP32 * config.head_dim
        key = (INDEXER_TOKEN_BYTES if production else FP32 * config.index_head_dim) if ratio == config.csa_ratio else 0
        total += entries_per_block(ratio) * (entry + key)
    return total


def bytes_per_slot(config: DeepseekV4Config, production: bool) -> int:
    """Bytes of one state slot, all layers: the window rows and the compressor states."""
    c, total = config, 0
    for ratio in c.compress_ratios:
        total += c.sliding_window * (V4_TOKEN_BYTES if production else FP32 * c.head_dim)
        if ratio:
            overlap = ratio == c.csa_ratio
            rows = ratio * (1 + overlap)
            total += 2 * FP32 * rows * c.head_dim * (1 + overlap)  # kv and score
            total += 2 * FP32 * rows * 2 * c.index_head_dim if ratio == c.csa_ratio else 0
    return total
