"""Sparse MLA decode over the FP8 paged cache through the native kernel of ``sparse_attention.cu``
(one CTA per query row, 64 heads and split of the top-k list: a producer warpgroup gathers and
dequantizes 64 tokens per stage into shared memory; one consumer warpgroup runs Q K^T, the online
softmax and half of P V, the other the second half of P V; with 128 heads and splits of at least 4
tiles the two head blocks run as a 2-CTA cluster that gathers each token once). Importing this module builds the
kernels' native extension once (``flashdsa.runtime.native``); a failed build raises ImportError,
so dispatch falls back to Triton and says why."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from flashdsa.runtime import native
from flashdsa.runtime.cache.layout import KV_LORA_RANK

native.load("kernels")

HEADS_PER_CTA = 64  # kSparseHeadsPerCta of sparse_attention.h
KEYS_PER_TILE = 64  # kSparseKeysPerTile: splits are cut at multiples of it
MAX_SPLITS = 128  # kSparseMaxSplits
MIN_TILES_PER_SPLIT = 2  # a split re-reads the 72 KB of q: at least two tiles of keys amortize it


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_count(ctas: int, topk: int, sms: int) -> int:
    """Splits of the top-k list so that ``ctas`` unsplit CTAs (one per SM) fill about one wave of
    ``sms`` SMs, none shorter than MIN_TILES_PER_SPLIT tiles."""
    tiles = math.ceil(topk / KEYS_PER_TILE)
    most = max(1, min(MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT))
    return max(1, min(most, sms // max(ctas, 1)))


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = KV_LORA_RANK,
    *,
    num_splits: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [b, s_q, h_q, 576] bf16 (h_q 64 or 128), kv_cache: [num_blocks, block_size, 1, 656]
    uint8, indices: [b, s_q, topk] int32 slot ids (topk <= 16384) -> (out [b, s_q, h_q, 512]
    bf16, lse [b, h_q, s_q] fp32).

    Inputs are validated by the public op (the C++ op checks them again); this backend needs d_v
    512. ``num_splits`` forces the split-KV count (tests); by default one wave of the GPU is
    filled. CUDA-graph capturable (no host sync).
    """
    if d_v != KV_LORA_RANK:
        raise ValueError(f"cuda sparse_mla_decode needs d_v {KV_LORA_RANK}, got {d_v}")
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    rows = b * s_q
    out = torch.empty(b, s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out, lse
    ctas = rows * (h_q // HEADS_PER_CTA)
    splits = num_splits or split_count(ctas, topk, _sm_count(q.device.index))
    per_split = math.ceil(math.ceil(topk / splits) / KEYS_PER_TILE) * KEYS_PER_TILE
    splits = math.ceil(topk / per_split)  # no empty split
    if splits > 1:
        part_out = torch.empty(rows, splits, h_q, d_v, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, splits, h_q, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out.new_empty(0, dtype=torch.float32)
    stream = torch._C._cuda_getCurrentRawStream(q.device.index)
    torch.ops.flashdsa.sparse_decode_cuda(q.contiguous(), kv_cache.contiguous(), indices.contiguous(), sm_scale,
                                          splits, per_split, out, lse, part_out, part_lse, stream)
    return out, lse
