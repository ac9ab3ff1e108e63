"""DeepSeek-V4 sparse attention in Triton: one kernel for prefill (bf16 rows) and decode (FP8
MODEL1 pages), with per-query top-k lengths, a second index set (the sliding window) and sinks.

A program takes one query row, a block of up to 64 heads and one split: the extra list (the window)
is cut into ``per_split`` positions first, then the main top-k list (so at batch 1 the window's keys
spread over programs too). The cut depends only on the batch shape, never on the lists' widths, so
a list padded to a CUDA graph's width splits exactly where the eager one does and the two agree
bit for bit. Each step gathers ``BLOCK_N`` keys as one bf16 ``[BLOCK_N, 512]``
tile (K = V): bf16 rows as they are, or MODEL1 tokens dequantized exactly (e4m3 times a
power-of-two UE8M0 scale is a bf16 value; the RoPE part is bf16 already), read as 8 tiles of 64
where tile 7 is the RoPE part. Scores and ``P @ V`` are bf16 tensor-core dots with an online
softmax in fp32 (base 2). Invalid ids (< 0, past the table, or past the row's length) are masked
before any load. With one split the kernel applies the sink and writes out / lse; otherwise it
writes fp32 partials that ``sparse_decode``'s combine kernel merges and applies the sink to.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from flashdsa.runtime.cache.layout_v4 import V4_DATA_BYTES, V4_NUM_TILES, V4_SCALE_BYTES, V4_TILE
from flashdsa.runtime.dispatch import interpreting
from flashdsa.runtime.kernels.triton._gather import LOG2E, mma, softmax_step
from flashdsa.runtime.kernels.triton.sparse_decode import DecodeConfig, _combine_kernel

PREFILL_CONFIG = DecodeConfig(block_n=32, num_stages=3)
DECODE_CONFIG = DecodeConfig(block_n=32, num_stages=3, min_tokens_per_split=64)
V4_BLOCK_H = 64
# The decode partition is sized for V4-Flash's 512 top-k entries plus the 128-token window, whatever
# a call's widths; lists wider than MAX_SPLITS splits of that size get longer splits.
NOMINAL_POSITIONS = 640
MAX_SPLITS = 64


@triton.jit
def _load_keys(kv_ptr, kv_bf16_ptr, row, valid, block_size, stride_kv, FP8: tl.constexpr,
               BLOCK_N: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr, TILE: tl.constexpr,
               DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Keys of table rows ``row: [BLOCK_N]`` (int64, 0 where invalid) as bf16 ``[BLOCK_N, D]``."""
    if FP8:  # MODEL1 page: [block_size x 576 data bytes | block_size x 8 scale bytes]
        tile = tl.arange(0, TILES + 1)
        col = tl.arange(0, TILE)
        block_base = (row // block_size) * block_size * (DATA_BYTES + SCALE_BYTES)
        offset = row % block_size
        data = block_base + offset * DATA_BYTES  # [N] byte offset of each token's data
        is_latent = tile < TILES
        lat = tl.load(kv_ptr + data[:, None, None] + tile[None, :, None] * TILE + col[None, None, :],
                      mask=valid[:, None, None] & is_latent[None, :, None], other=0)
        exponent = tl.load(kv_ptr + (block_base + block_size * DATA_BYTES + offset * SCALE_BYTES)[:, None]
                           + tile[None, :], mask=valid[:, None] & is_latent[None, :], other=0)
        scale = (exponent.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # UE8M0 -> 2^(e - 127)
        rope_at = (data + TILES * TILE) // 2
        rope = tl.load(kv_bf16_ptr + rope_at[:, None, None] + (tile[None, :, None] - TILES) * TILE + col[None, None, :],
                       mask=valid[:, None, None] & (tile == TILES)[None, :, None], other=0.0)
        keys = lat.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
        keys = tl.where((tile == TILES)[None, :, None], rope.to(tl.float32), keys)
        return tl.reshape(keys.to(tl.bfloat16), (BLOCK_N, D))
    else:
        return tl.load(kv_ptr + row[:, None] * stride_kv + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _attend_segment(q, m, l, acc, kv_ptr, kv_bf16_ptr, idx_row, start, end, num_rows, block_size, stride_kv,
                    scale_log2, FP8: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr,
                    TILE: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Online-softmax state (m, l, acc) updated with positions [start, end) of one index row."""
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + pos, mask=pos < end, other=-1)
        valid = (idx >= 0) & (idx < num_rows)
        row = tl.where(valid, idx, 0).to(tl.int64)
        k = _load_keys(kv_ptr, kv_bf16_ptr, row, valid, block_size, stride_kv, FP8, BLOCK_N, D, TILES, TILE,
                       DATA_BYTES, SCALE_BYTES)
        s = mma(q, tl.trans(k), None, INTERPRET)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m, l, acc = softmax_step(s, m, l, acc, k, INTERPRET)
    return m, l, acc


@triton.jit(do_not_specialize=["h_q", "num_rows", "extra_rows", "topk", "extra_topk", "per_split", "extra_splits"])
def _sparse_v4_kernel(
    q_ptr, kv_ptr, kv_bf16_ptr, idx_ptr, len_ptr, extra_kv_ptr, extra_kv_bf16_ptr, extra_idx_ptr, extra_len_ptr,
    sink_ptr, out_ptr, lse_ptr,
    h_q, s_q, num_rows, block_size, extra_rows, extra_block_size, topk, extra_topk, per_split, extra_splits,
    scale_log2,
    stride_q_row, stride_q_h, stride_kv, stride_idx, stride_extra_kv, stride_extra_idx,
    FP8: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_EXTRA_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr, DIRECT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, TILES: tl.constexpr, TILE: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = heads < h_q
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_h + tl.arange(0, D)[None, :],
                mask=head_ok[:, None], other=0.0)
    end = topk
    if HAS_LEN:  # lengths are per query row (prefill, s_q = 1 here) or per request (decode)
        length = tl.load(len_ptr + row // s_q)
        if length < end:  # (plain ifs, not tl.minimum: the interpreter cannot loop to a 1-element tensor)
            end = length
    start = (split - extra_splits) * per_split  # splits [0, extra_splits) take the extra list
    stop = start + per_split
    if stop > end:
        stop = end
    if start < 0:
        start = 0
        stop = 0

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    m, l, acc = _attend_segment(q, m, l, acc, kv_ptr, kv_bf16_ptr, idx_ptr + row * stride_idx, start, stop,
                                num_rows, block_size, stride_kv, scale_log2, FP8, BLOCK_N, D, TILES, TILE,
                                DATA_BYTES, SCALE_BYTES, INTERPRET)
    if HAS_EXTRA:
        extra_end = extra_topk
        if HAS_EXTRA_LEN:
            extra_length = tl.load(extra_len_ptr + row // s_q)
            if extra_length < extra_end:
                extra_end = extra_length
        extra_start = split * per_split
        if extra_start + per_split < extra_end:
            extra_end = extra_start + per_split
        extra_row = extra_idx_ptr + row * stride_extra_idx
        m, l, acc = _attend_segment(q, m, l, acc, extra_kv_ptr, extra_kv_bf16_ptr, extra_row, extra_start, extra_end,
                                    extra_rows, extra_block_size, stride_extra_kv, scale_log2, FP8, BLOCK_N, D, TILES,
                                    TILE, DATA_BYTES, SCALE_BYTES, INTERPRET)

    empty = l == 0.0
    lse = tl.where(empty, float("-inf"), (m + tl.math.log2(tl.where(empty, 1.0, l))) / 1.4426950408889634)
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l))
    cols = tl.arange(0, D)[None, :]
    out = acc * inv_l[:, None]
    if DIRECT:  # out [rows, h_q, D]; lse [rows // s_q, h_q, s_q]
        if HAS_SINK:  # (rounded as the combine rounds one split, so one split or several agree)
            sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0)
            out = out * (1.0 / (1.0 + tl.exp(tl.where(empty, 0.0, sink - lse))))[:, None]
        tl.store(out_ptr + (row * h_q + heads[:, None]) * D + cols, out.to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None])
        tl.store(lse_ptr + (row // s_q) * h_q * s_q + heads * s_q + row % s_q, tl.where(empty, float("inf"), lse),
                 mask=head_ok)
    else:  # fp32 partials: out [rows, splits, h_q, D], lse [rows, splits, h_q]
        part = row * tl.num_programs(2) + split
        tl.store(out_ptr + (part * h_q + heads[:, None]) * D + cols, out, mask=head_ok[:, None])
        tl.store(lse_ptr + part * h_q + heads, lse, mask=head_ok)


def _partition(programs: int, widths: int, config: DecodeConfig, num_splits: Optional[int]) -> int:
    """Positions per split for ``programs`` (query rows x head blocks) over lists of ``widths``
    positions in all: as many splits of NOMINAL_POSITIONS as keep the programs within
    ``config.target_programs``, none shorter than ``config.min_tokens_per_split``; ``num_splits``
    (tests) cuts ``widths`` into that many instead."""
    if num_splits:
        return triton.cdiv(triton.cdiv(max(widths, 1), num_splits), config.block_n) * config.block_n
    wanted = max(1, config.target_programs // programs)
    positions = max(config.min_tokens_per_split, triton.cdiv(NOMINAL_POSITIONS, wanted), triton.cdiv(widths, MAX_SPLITS))
    return triton.cdiv(positions, config.block_n) * config.block_n


def _launch(q_rows, s_q, kv, extra_kv, indices, extra_indices, topk_length, extra_topk_length, attn_sink, sm_scale,
            out, lse, fp8: bool, per_split: Optional[int], config: DecodeConfig) -> None:
    """Run the kernel (and the combine when there are several splits) for ``q_rows: [rows, h_q,
    512]``, ``per_split`` positions a split (None: one split walks both lists). ``kv`` /
    ``extra_kv``: 2-D bf16 row tables (prefill) or 4-D MODEL1 pools (decode)."""
    rows, h_q, d = q_rows.shape
    topk = indices.shape[-1]
    # 64 heads per program whatever h_q: with 32 (or 16) the kernel's layouts need 262 KB of shared
    # memory, past the 227 KB of SM90/SM100; fewer heads run as padding rows of one block.
    block_h, head_blocks = V4_BLOCK_H, triton.cdiv(h_q, V4_BLOCK_H)
    extra_width = extra_indices.shape[-1] if extra_kv is not None else 0
    if per_split is None:
        per_split, extra_splits, splits = max(topk, extra_width, 1), 0, 1
    else:
        extra_splits = triton.cdiv(extra_width, per_split)
        splits = max(1, extra_splits + triton.cdiv(topk, per_split))
    direct = splits == 1
    part_out, part_lse = (out, lse) if direct else (
        torch.empty(rows, splits, h_q, d, dtype=torch.float32, device=q_rows.device),
        torch.empty(rows, splits, h_q, dtype=torch.float32, device=q_rows.device))

    def table(t):  # (pointer, bf16 view, rows or slots, block size, row stride)
        if fp8:
            return t, t.view(torch.bfloat16), t.shape[0] * t.shape[1], t.shape[1], 0
        return t, t, t.shape[0], 1, t.stride(0)

    kv_args = table(kv)
    has_extra = extra_kv is not None
    extra_args = table(extra_kv) if has_extra else kv_args
    extra_idx = extra_indices if has_extra else indices
    dummy = lse  # any tensor: pointers of absent optional inputs are never read
    _sparse_v4_kernel[(rows, head_blocks, splits)](
        q_rows, kv_args[0], kv_args[1], indices, topk_length if topk_length is not None else dummy,
        extra_args[0], extra_args[1], extra_idx, extra_topk_length if extra_topk_length is not None else dummy,
        attn_sink if attn_sink is not None else dummy, part_out, part_lse,
        h_q, s_q, kv_args[2], kv_args[3], extra_args[2], extra_args[3], topk, extra_idx.shape[-1], per_split,
        extra_splits, sm_scale * LOG2E, q_rows.stride(0), q_rows.stride(1), kv_args[4], indices.stride(0), extra_args[4],
        extra_idx.stride(0),
        FP8=fp8, HAS_LEN=topk_length is not None, HAS_EXTRA=has_extra, HAS_EXTRA_LEN=extra_topk_length is not None,
        HAS_SINK=attn_sink is not None, DIRECT=direct, BLOCK_H=block_h, BLOCK_N=config.block_n, D=d,
        TILES=V4_NUM_TILES, TILE=V4_TILE, DATA_BYTES=V4_DATA_BYTES, SCALE_BYTES=V4_SCALE_BYTES,
        INTERPRET=interpreting(), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not direct:
        _combine_kernel[(rows, h_q)](
            part_out, part_lse, out, lse, attn_sink if attn_sink is not None else dummy, h_q, splits, s_q,
            SPLITS=triton.next_power_of_2(splits), D_V=d, HAS_SINK=attn_sink is not None, num_warps=4,
        )


def sparse_attention_v4_prefill(q, kv, indices, sm_scale, topk_length=None, attn_sink=None, extra_kv=None,
                                extra_indices=None, extra_topk_length=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [s_q, h_q, 512] bf16, kv [s_kv, 1, 512] bf16, indices [s_q, 1, topk] int32 (+ optional extra
    set, lengths [s_q], sinks [h_q]) -> (out [s_q, h_q, 512] bf16, lse [s_q, h_q] fp32). Inputs validated."""
    s_q, h_q, d = q.shape
    out = torch.empty(s_q, h_q, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    if s_q == 0:
        return out, lse
    extra = extra_kv[:, 0] if extra_kv is not None else None
    extra_idx = extra_indices[:, 0] if extra_indices is not None else None
    _launch(q, 1, kv[:, 0], extra, indices[:, 0], extra_idx, topk_length, extra_topk_length, attn_sink, sm_scale,
            out, lse, fp8=False, per_split=None, config=PREFILL_CONFIG)
    return out, lse


def sparse_attention_v4_decode(q, kv_cache, indices, sm_scale, topk_length=None, attn_sink=None, extra_kv_cache=None,
                               extra_indices=None, extra_topk_length=None, *, num_splits: Optional[int] = None,
                               config: Optional[DecodeConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, s_q, h_q, 512] bf16, kv_cache [nb, bs, 1, 584] uint8, indices [b, s_q, topk] int32 slot
    ids (+ optional extra pool and ids, lengths [b], sinks [h_q]) -> (out [b, s_q, h_q, 512] bf16,
    lse [b, h_q, s_q] fp32). ``num_splits`` cuts the positions into about that many splits (tests)."""
    b, s_q, h_q, d = q.shape
    config = config or DECODE_CONFIG
    out = torch.empty(b, s_q, h_q, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    if b * s_q == 0:
        return out, lse
    rows = b * s_q
    topk = indices.shape[-1]
    extra_idx = extra_indices.reshape(rows, -1) if extra_indices is not None else None
    widths = topk + (extra_idx.shape[-1] if extra_kv_cache is not None else 0)
    per_split = _partition(rows * triton.cdiv(h_q, V4_BLOCK_H), widths, config, num_splits)
    _launch(q.reshape(rows, h_q, d), s_q, kv_cache, extra_kv_cache, indices.reshape(rows, topk), extra_idx,
            topk_length, extra_topk_length, attn_sink, sm_scale, out, lse, fp8=True, per_split=per_split, config=config)
    return out, lse
