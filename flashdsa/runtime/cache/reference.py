"""Reference (torch) cache writes: quantize each token and scatter it to its slot.

No validation here: the public functions in ``flashdsa.runtime.cache`` check inputs first.
Slots outside ``[0, num_blocks * block_size)`` are skipped, so nothing is written out of bounds.
"""

from __future__ import annotations

import torch

from flashdsa.runtime.cache.layout import dequantize_mla, indexer_block_views, quantize_indexer_key, quantize_mla
from flashdsa.runtime.cache.layout_v4 import quantize_v4, v4_block_views
from flashdsa.runtime.indexer.reference import hadamard_transform


def _valid_slots(slot_mapping: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return (slot_mapping >= 0) & (slot_mapping < cache.shape[0] * cache.shape[1])


def write_mla_cache(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Pack ``c_kv: [T, 512]`` and ``k_pe: [T, 64]`` into 656-byte tokens at ``slot_mapping: [T]``."""
    valid = _valid_slots(slot_mapping, kv_cache)
    tokens = quantize_mla(c_kv[valid], k_pe[valid])
    kv_cache.view(-1, tokens.shape[-1])[slot_mapping[valid]] = tokens


def write_v4_cache(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``kv: [T, 512]`` to the V4 MODEL1 format and scatter it to ``slot_mapping: [T]``."""
    valid = _valid_slots(slot_mapping, kv_cache)
    data, scales = quantize_v4(kv[valid])
    slots = slot_mapping[valid]
    block, offset = slots // kv_cache.shape[1], slots % kv_cache.shape[1]
    data_view, scale_view = v4_block_views(kv_cache)
    data_view[block, offset] = data
    scale_view[block, offset] = scales


def write_indexer_cache(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Hadamard-rotate ``k: [T, 128]``, quantize with power-of-two scales and scatter to ``slot_mapping: [T]``."""
    valid = _valid_slots(slot_mapping, k_cache)
    q, scale = quantize_indexer_key(hadamard_transform(k[valid]))
    slots = slot_mapping[valid]
    block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    keys, scales = indexer_block_views(k_cache)
    keys[block, offset] = q
    scales[block, offset] = scale


def positions_to_slots(positions: torch.Tensor, seq_ids: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    table = block_tables.long()[seq_ids]  # [T, max_blocks]
    pos = positions.long()
    page = pos.clamp_min(0) // block_size
    listed = (pos >= 0) & (page < table.shape[1])
    block = table.gather(1, page.clamp_max(table.shape[1] - 1))
    slots = block * block_size + pos % block_size
    return torch.where(listed & (block >= 0), slots, -1).to(torch.int32)


def dequantize_mla_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N * block_size, 1, 576]`` rows of the blocks ``block_ids: [N]`` (zeros for unlisted ids)."""
    listed = (block_ids >= 0) & (block_ids < kv_cache.shape[0])
    keys = dequantize_mla(kv_cache[torch.where(listed, block_ids, 0).long()])  # [N, block_size, 1, 576] fp32
    keys = torch.where(listed[:, None, None, None], keys, 0.0)
    return keys.to(dtype).reshape(-1, 1, keys.shape[-1])
