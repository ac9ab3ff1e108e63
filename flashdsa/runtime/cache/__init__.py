"""Paged FP8 caches: byte layouts (``layout``), pools (``pool``), the block allocator
(``allocator``), the cache-write ops, the position-to-slot mapping and the MLA blocks' dequantized
read below (validation + backend dispatch).

Backends of each op, registered lazily:
  reference  flashdsa.runtime.cache.reference:<op>
  triton     flashdsa.runtime.cache.triton.writes:write_mla_cache / :write_indexer_cache,
             flashdsa.runtime.cache.triton.writes_v4:write_v4_cache,
             flashdsa.runtime.cache.triton.slots:positions_to_slots,
             flashdsa.runtime.cache.triton.dequantize:dequantize_mla_blocks (bf16 out)
Backend functions take the same positional arguments (no ``backend``); the writes write in place
and must skip slots < 0 or >= num_blocks * block_size.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.cache.layout import (
    BLOCK_SIZE,
    INDEX_HEAD_DIM,
    INDEXER_TOKEN_BYTES,
    KV_LORA_RANK,
    MLA_TOKEN_BYTES,
    ROPE_DIM,
)
from flashdsa.runtime.cache.layout_v4 import V4_HEAD_DIM, V4_TOKEN_BYTES
from flashdsa.runtime.checks import can_check_values, check, check_tensor

FLOATS = (torch.bfloat16, torch.float16, torch.float32)

for _op, _module in (("write_mla_cache", "writes"), ("write_indexer_cache", "writes"), ("write_v4_cache", "writes_v4"),
                     ("positions_to_slots", "slots")):
    dispatch.register(_op, "reference", f"flashdsa.runtime.cache.reference:{_op}")
    dispatch.register(_op, "triton", f"flashdsa.runtime.cache.triton.{_module}:{_op}")
dispatch.register("dequantize_mla_blocks", "reference", "flashdsa.runtime.cache.reference:dequantize_mla_blocks")
dispatch.register("dequantize_mla_blocks", "triton", "flashdsa.runtime.cache.triton.dequantize:dequantize_mla_blocks",
                  supports=lambda dtype, **_: None if dtype == torch.bfloat16 else f"triton writes bf16, got {dtype}")


def _check_rows(name: str, t: torch.Tensor) -> None:
    """Rows may be strided (e.g. a slice of a fused projection) but each row must be contiguous."""
    check(t.shape[0] == 0 or t.stride(-1) == 1, f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _check_slots(slot_mapping: object, num_tokens: int, cache: torch.Tensor) -> None:
    """slot_mapping: [T] int64 on the cache's device, every slot < the cache's capacity, no slot twice.

    The value checks read two numbers back (one device sync); they are skipped inside
    ``checks.trusted_values`` and while a CUDA graph is being captured, where backends still skip
    out-of-range slots instead of writing them (a repeated slot is then written by one of its tokens).
    """
    check_tensor("slot_mapping", slot_mapping, torch.int64, [num_tokens], f"int64 [T={num_tokens}]", cache.device)
    capacity = cache.shape[0] * cache.shape[1]
    if num_tokens and can_check_values(cache.device):
        ordered = slot_mapping.sort().values
        repeated = torch.where((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0), ordered[1:], -1)
        twice = torch.cat([repeated, ordered.new_full((1,), -1)]).max()  # the largest repeated slot, or -1
        top, twice = torch.stack([ordered[-1], twice]).tolist()
        check(top < capacity, f"slot_mapping has slot {top}, beyond the cache's {capacity} slots")
        check(twice < 0, f"slot_mapping has slot {twice} twice: each token needs its own slot")


def write_mla_cache(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Optional[str] = None,
) -> None:
    """Quantize tokens into the MLA latent cache, in place.

    c_kv: [T, 512] bf16/fp16/fp32, the normalized latent (e4m3 with one amax/448 scale per 128).
    k_pe: [T, 64] same dtype, the RoPE'd key part (stored as bf16).
        c_kv and k_pe may be row-strided views (e.g. of one [T, 576] projection); last dim contiguous.
    kv_cache: [num_blocks, block_size, 1, 656] uint8 pool (layout in ``cache.layout``).
    slot_mapping: [T] int64, slot ``block_id * block_size + offset`` of each token; slots < 0 are
        skipped (padding tokens); slots must be distinct (a repeated slot is a ValueError).
    """
    check_tensor("c_kv", c_kv, FLOATS, [None, KV_LORA_RANK], "bf16/fp16/fp32 [T, 512]", contiguous=False)
    _check_rows("c_kv", c_kv)
    num_tokens = c_kv.shape[0]
    check_tensor("k_pe", k_pe, c_kv.dtype, [num_tokens, ROPE_DIM], f"{c_kv.dtype} [T={num_tokens}, 64]",
                 c_kv.device, contiguous=False)
    _check_rows("k_pe", k_pe)
    check_tensor("kv_cache", kv_cache, torch.uint8, [None, None, 1, MLA_TOKEN_BYTES],
                 "uint8 [num_blocks, block_size, 1, 656]", c_kv.device)
    _check_slots(slot_mapping, num_tokens, kv_cache)
    dispatch.select("write_mla_cache", kv_cache.device, backend)(c_kv, k_pe, kv_cache, slot_mapping)


def write_v4_cache(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                   backend: Optional[str] = None) -> None:
    """Quantize DeepSeek-V4 K=V rows into the 584 B/token MODEL1 cache, in place.

    kv: [T, 512] bf16/fp16/fp32, ``[latent (448) | RoPE'd part (64)]`` (e4m3 with a power-of-two
        scale per 64 latents; the RoPE part stored as bf16). Rows may be strided; last dim contiguous.
    kv_cache: [num_blocks, block_size, 1, 584] uint8 pool (per-block layout in ``cache.layout_v4``).
    slot_mapping: [T] int64 slots as in :func:`write_mla_cache`: distinct; slots < 0 are skipped.
    """
    check_tensor("kv", kv, FLOATS, [None, V4_HEAD_DIM], "bf16/fp16/fp32 [T, 512]", contiguous=False)
    _check_rows("kv", kv)
    check_tensor("kv_cache", kv_cache, torch.uint8, [None, None, 1, V4_TOKEN_BYTES],
                 f"uint8 [num_blocks, block_size, 1, {V4_TOKEN_BYTES}]", kv.device)
    _check_slots(slot_mapping, kv.shape[0], kv_cache)
    dispatch.select("write_v4_cache", kv_cache.device, backend)(kv, kv_cache, slot_mapping)


def write_indexer_cache(
    k: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Optional[str] = None,
) -> None:
    """Hadamard-rotate, quantize (e4m3, power-of-two per-token scale) and store indexer keys, in place.

    k: [T, 128] bf16/fp16/fp32, the indexer keys before the Hadamard rotation.
    k_cache: [num_blocks, block_size, 1, 132] uint8 pool (per-block layout in ``cache.layout``).
    slot_mapping: [T] int64 slots as in :func:`write_mla_cache`: distinct; slots < 0 are skipped.
    """
    check_tensor("k", k, FLOATS, [None, INDEX_HEAD_DIM], "bf16/fp16/fp32 [T, 128]", contiguous=False)
    _check_rows("k", k)
    check_tensor("k_cache", k_cache, torch.uint8, [None, None, 1, INDEXER_TOKEN_BYTES],
                 "uint8 [num_blocks, block_size, 1, 132]", k.device)
    _check_slots(slot_mapping, k.shape[0], k_cache)
    dispatch.select("write_indexer_cache", k_cache.device, backend)(k, k_cache, slot_mapping)


def positions_to_slots(positions: torch.Tensor, seq_ids: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int = BLOCK_SIZE, *, backend: Optional[str] = None) -> torch.Tensor:
    """Cache slots of per-token positions: ``block_tables[seq_ids[t], p // block_size] * block_size
    + p % block_size`` for each position p of row t; graph-capturable (no host sync).

    positions: [T, k] int32/int64 (rows may be strided), -1 = none (e.g. the indexer's padding).
    seq_ids: [T] int64, the sequence of each token, in [0, B). block_tables: [B, max_blocks] int32,
    -1 padded. Returns [T, k] int32: -1 where the position is < 0, past the table, or on a -1 block.
    One kernel on a GPU (the torch expression is ~8, once a layer).
    """
    check_tensor("positions", positions, (torch.int32, torch.int64), [None, None], "int32/int64 [T, k]",
                 contiguous=False)
    check(positions.numel() == 0 or positions.stride(-1) == 1,
          f"positions must have a contiguous last dim, got strides {positions.stride()}")
    tokens = positions.shape[0]
    check_tensor("seq_ids", seq_ids, torch.int64, [tokens], f"int64 [T={tokens}]", positions.device)
    check_tensor("block_tables", block_tables, torch.int32, [None, None], "int32 [B, max_blocks]", positions.device)
    check(isinstance(block_size, int) and block_size >= 1, f"block_size must be an int >= 1, got {block_size!r}")
    if tokens and can_check_values(positions.device):
        low, high = int(seq_ids.min()), int(seq_ids.max())
        check(low >= 0 and high < block_tables.shape[0],
              f"seq_ids must lie in [0, B={block_tables.shape[0]}), got values in [{low}, {high}]")
    return dispatch.select("positions_to_slots", positions.device, backend)(positions, seq_ids, block_tables, block_size)


def dequantize_mla_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                          backend: Optional[str] = None) -> torch.Tensor:
    """Key rows of whole blocks of the FP8 MLA cache, for attention kernels that read plain rows.

    kv_cache: [num_blocks, block_size, 1, 656] uint8 pool. block_ids: [N] int32/int64, the blocks
    to read; an id < 0 or >= num_blocks gives zero rows (e.g. a block table's -1 padding).
    Returns ``[N * block_size, 1, 576]`` in ``dtype`` (bf16, or fp32/fp64 on the reference
    backend): row ``j * block_size + o`` is token o of block ``block_ids[j]``, latent
    (e4m3 x scale) then k_pe, as the decode kernels dequantize it. The sparse prefill runs
    ``sparse_mla_fwd`` over these rows (the model's ``attention_runs``).
    """
    check_tensor("kv_cache", kv_cache, torch.uint8, [None, None, 1, MLA_TOKEN_BYTES],
                 "uint8 [num_blocks, block_size, 1, 656]")
    check_tensor("block_ids", block_ids, (torch.int32, torch.int64), [None], "int32/int64 [N]", kv_cache.device)
    check(dtype in (torch.bfloat16, torch.float32, torch.float64), f"dtype must be bf16, fp32 or fp64, got {dtype}")
    return dispatch.select("dequantize_mla_blocks", kv_cache.device, backend, dtype=dtype)(kv_cache, block_ids, dtype)
