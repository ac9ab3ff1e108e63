"""The model's paged caches and the token-position bookkeeping over them.

Two precision modes share one paging scheme (block size 64, slot = block_id * 64 + offset):
  production  the FP8 pools of ``flashdsa.runtime.cache`` (656 B/token MLA, 132 B/token indexer)
  reference   unquantized fp32 pools of the same shape, one float per value: the MLA pool holds
              ``[c_kv, k_pe]`` (d_qk floats) and the indexer pool the keys before any Hadamard.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from flashdsa.models.config import DeepseekV32Config
from flashdsa.runtime.cache import positions_to_slots as cache_positions_to_slots
from flashdsa.runtime.cache import dequantize_mla_blocks, write_indexer_cache, write_mla_cache
from flashdsa.runtime.cache.layout import BLOCK_SIZE, INDEXER_TOKEN_BYTES, MLA_TOKEN_BYTES, indexer_block_views
from flashdsa.runtime.cache.pool import indexer_pool, mla_pool
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.metadata import BatchMetadata

MODES = ("reference", "production")


@dataclass
class ModelCaches:
    """Per-layer pools: ``mla[i]: [num_blocks, 64, 1, 656] uint8`` (reference: ``[.., d_qk] fp32``),
    ``indexer[i]: [num_blocks, 64, 1, 132] uint8`` (reference: ``[.., index_head_dim] fp32``)."""

    mla: list[torch.Tensor]
    indexer: list[torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return self.mla[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.mla[0].shape[1]


def allocate_caches(config: DeepseekV32Config, mode: str, num_blocks: int, device: torch.device,
                    num_layers: int | None = None) -> ModelCaches:
    """Pools for ``num_layers`` layers (default the main stack; the MTP layer adds one)."""
    layers = range(config.num_hidden_layers if num_layers is None else num_layers)
    if mode == "production":
        return ModelCaches(
            [mla_pool(num_blocks, device) for _ in layers], [indexer_pool(num_blocks, device) for _ in layers]
        )
    shape = (num_blocks, BLOCK_SIZE, 1)
    return ModelCaches(
        [torch.zeros(*shape, config.d_qk, device=device) for _ in layers],
        [torch.zeros(*shape, config.index_head_dim, device=device) for _ in layers],
    )


def cache_bytes_per_block(config: DeepseekV32Config, mode: str, num_layers: int | None = None) -> int:
    """Bytes one 64-token block takes over ``num_layers`` layers (default the main stack), both caches."""
    if mode == "production":
        per_token = MLA_TOKEN_BYTES + INDEXER_TOKEN_BYTES
    else:
        per_token = 4 * (config.d_qk + config.index_head_dim)
    return (config.num_hidden_layers if num_layers is None else num_layers) * BLOCK_SIZE * per_token


def store_latent(pool: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``c_kv: [T, kv_lora_rank]``, ``k_pe: [T, rope]`` at ``slots: [T]`` (< 0 skipped)."""
    if pool.dtype == torch.uint8:
        write_mla_cache(c_kv, k_pe, pool, slots)
    else:
        store_rows(pool, torch.cat([c_kv, k_pe], dim=-1), slots)


def store_index_key(pool: torch.Tensor, k: torch.Tensor, slots: torch.Tensor) -> None:
    """Write indexer keys ``k: [T, index_head_dim]`` (production: rotated + FP8 by the cache op)."""
    if pool.dtype == torch.uint8:
        write_indexer_cache(k, pool, slots)
    else:
        store_rows(pool, k, slots)


def store_rows(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Unquantized rows ``[T, width]`` into a float pool ``[..., width]`` at flat ``slots: [T]`` (< 0 skipped)."""
    keep = slots >= 0
    pool.view(-1, pool.shape[-1])[slots[keep]] = rows[keep].to(pool.dtype)


def gather_rows(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens ``[length, width]`` of one sequence from a pool ``[num_blocks, 64, width]``."""
    blocks = block_table[: -(-length // pool.shape[1])].long()
    return pool[blocks].reshape(-1, pool.shape[-1])[:length]


def gather_fp8_keys(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` indexer keys of one sequence from the FP8 pool: (e4m3 [L, 128], fp32 scales [L])."""
    keys, scales = indexer_block_views(pool)  # [nb, 64, 128] e4m3, [nb, 64] fp32
    k_fp8 = gather_rows(keys.view(torch.uint8), block_table, length).view(E4M3)
    return k_fp8, gather_rows(scales[..., None], block_table, length)[:, 0]


def positions_to_slots(positions: torch.Tensor, meta: BatchMetadata, block_size: int = BLOCK_SIZE,
                       tokens: slice = slice(None)) -> torch.Tensor:
    """Map the cache positions ``[t, k]`` (-1 = none) of the step's ``tokens`` (default all) to slot
    ids ``[t, k]`` int32 (-1 kept)."""
    return cache_positions_to_slots(positions, meta.seq_ids[tokens], meta.block_tables, block_size)


# Sequences attend over a dequantized copy of their blocks when their context holds at most this
# many tokens per query token (a prompt or a prompt's chunk: the copy is read and written once per
# layer, and a query row's attention costs as much as ~500 tokens of it), and when consecutive such
# sequences bring at least this many query tokens (the forward has no split over the top-k: fewer
# rows leave SMs idle, where the decode kernel splits).
DEQUANTIZED_TOKENS_PER_QUERY = 16
DEQUANTIZED_MIN_TOKENS = 512


@dataclass(frozen=True)
class AttentionRun:
    """Consecutive sequences ``[first, end)`` of a step (tokens ``[token_first, token_end)``) whose
    FP8-cache attention runs one way: ``sparse_mla_fwd`` over bf16 rows of their blocks
    (``dequantized``, whose ``width`` blocks per sequence cover their contexts) or the decode
    kernel over the cache. Host ints only."""

    first: int
    end: int
    token_first: int
    token_end: int
    dequantized: bool
    width: int = 0

    @property
    def tokens(self) -> slice:
        return slice(self.token_first, self.token_end)


def attention_runs(meta: BatchMetadata, block_size: int = BLOCK_SIZE) -> tuple[AttentionRun, ...]:
    """The step's sequences in order, grouped into runs (FlashMLA's prefill reads bf16 keys too;
    a decode batch stays on the decode kernel; a step that mixes decodes with a prompt's chunk, as
    chunked prefill does, runs each part its way). One run for most steps."""
    total = sum(meta.query_lens)
    if total < DEQUANTIZED_MIN_TOKENS:  # every decode step: no per-sequence pass
        return (AttentionRun(0, len(meta.query_lens), 0, total, False),)
    return _grouped_runs(tuple(meta.query_lens), tuple(meta.context_lens_host), block_size,
                         DEQUANTIZED_TOKENS_PER_QUERY, DEQUANTIZED_MIN_TOKENS)


@functools.lru_cache(maxsize=16)
def _grouped_runs(query_lens: tuple[int, ...], context_lens: tuple[int, ...], block_size: int, per_query: int,
                  min_tokens: int) -> tuple[AttentionRun, ...]:
    """attention_runs of a step of at least ``min_tokens`` tokens, from its host ints and the two
    thresholds: every layer of a step asks again with the same ones, so the pass over the sequences
    runs once a step."""
    runs: list[AttentionRun] = []  # consecutive sequences with the same prompt-likeness
    token = 0
    for b, (n, length) in enumerate(zip(query_lens, context_lens)):
        prompt = length <= per_query * n
        width = -(-length // block_size) if prompt else 0
        if runs and runs[-1].dequantized == prompt:
            runs[-1] = replace(runs[-1], end=b + 1, token_end=token + n, width=max(runs[-1].width, width))
        else:
            runs.append(AttentionRun(b, b + 1, token, token + n, prompt, width))
        token += n
    merged: list[AttentionRun] = []  # prompt runs too small (or too padded) join the decode runs
    for run in runs:
        n = run.token_end - run.token_first
        rows = (run.end - run.first) * run.width * block_size
        if run.dequantized and (n < min_tokens or rows > per_query * n):
            run = replace(run, dequantized=False, width=0)
        if merged and not run.dequantized and not merged[-1].dequantized:
            merged[-1] = replace(merged[-1], end=run.end, token_end=run.token_end)
        else:
            merged.append(run)
    return tuple(merged)


def dequantized_keys(pool: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata, run: AttentionRun,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's blocks as key rows ``[sequences * width * block_size, 1, 576]`` (each sequence's
    first ``run.width`` table entries in turn, so position p of the run's j-th sequence is row
    ``j * width * block_size + p``), and the rows ``[t, k]`` int32 of its tokens' cache
    ``positions: [t, k]`` (-1 kept)."""
    width = min(run.width, meta.block_tables.shape[1])  # a bound with room for a draft may pass the table
    keys = dequantize_mla_blocks(pool, meta.block_tables[run.first : run.end, :width].flatten(), dtype)
    per_sequence = width * pool.shape[1]
    offsets = (meta.seq_ids[run.tokens] - run.first) * per_sequence
    rows = torch.where(positions >= 0, positions + offsets[:, None], -1)
    return keys, rows.to(torch.int32)
