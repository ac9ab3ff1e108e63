"""Indexer logits in Triton with FP8 tensor-core dots (ragged prefill ranges and paged decode).

``score[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q_fp8[t, h] . k_fp8[s])``: a ragged
program takes ROWS_PER_PROGRAM queries and a run of key tiles; a key tile is the M dim of an e4m3
``tl.dot`` and the queries' heads its N, so each tile is read straight from the FP8 store once for
all the program's queries and the head sum runs along N. The paged kernel reads whole 64-token
blocks of the indexer pool through the block table (one or more per step, masked past the
context, so table entries beyond it are never used), with the n query tokens of a request and
their heads on N (or, by a knob, on M) so a block is read once for all of them. Both loop over
key tiles with plain bounds (tiles past every range are only filled with -inf), so their loads
pipeline. Accumulation is fp32; on SM90 the FP8 tensor cores add with reduced precision inside a
run of steps, so the dots are promoted to fp32 after each run (``max_num_imprecise_acc``): here
once per 128-deep dot, as DeepGEMM does. Promoting every 32 kept two accumulators live, and the
kernels spilled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.cache.layout import INDEX_HEAD_DIM

BLOCK_S = 128  # keys per dot in the ragged kernel
ROWS_PER_PROGRAM = 2  # queries per ragged program: each key tile read once for all of them
TILES_PER_PROGRAM = 8  # key tiles one ragged program walks
STEPS_PER_PROGRAM = 16  # steps of whole cache blocks one paged program walks


def _pad_heads(num_heads: int) -> int:
    return max(16, triton.next_power_of_2(num_heads))


@triton.jit
def _minus_inf_tiles(out_ptr, rows, live, cols_from, cols_to, num_cols, stride_out,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """-inf into columns [cols_from, cols_to) (whole tiles from cols_from) of the given rows."""
    for c in range(cols_from, cols_to, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        minus_inf = tl.full([BLOCK, ROWS], float("-inf"), tl.float32)
        tl.store(out_ptr + rows[None, :] * stride_out + cols[:, None], minus_inf,
                 mask=live[None, :] & (cols < num_cols)[:, None])


@triton.jit
def _ragged_kernel(q_ptr, w_ptr, k_ptr, k_scale_ptr, starts_ptr, ends_ptr, out_ptr,
                   num_q, num_heads, col0, num_cols, stride_q, stride_w, stride_out,
                   H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, ROWS: tl.constexpr):
    """Rows [t0, t0 + ROWS) and key columns [c_lo, c_lo + BLOCK * TILES) of the window [col0, col0 + num_cols).
    A key tile is the dot's M and the rows' heads its N (column n: row n // H, head n % H), so each
    tile is read once for ROWS rows and the head sum runs along N; tiles no row's range touches are
    only filled with -inf, so the scoring loop has plain bounds and its loads pipeline."""
    t0 = tl.program_id(0) * ROWS
    c_lo = tl.program_id(1) * BLOCK * TILES
    c_end = c_lo + BLOCK * TILES
    row = t0 + tl.arange(0, ROWS)
    live = row < num_q
    start = tl.load(starts_ptr + row, mask=live, other=2**31 - 1)  # rows past the last: empty ranges
    end = tl.load(ends_ptr + row, mask=live, other=0)
    n = tl.arange(0, ROWS * H)
    n_row, n_head = t0 + n // H, n % H
    n_live = (n_row < num_q) & (n_head < num_heads)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + n_row.to(tl.int64)[None, :] * stride_q + n_head[None, :] * D + d[:, None],
                mask=n_live[None, :], other=0.0)  # [D, ROWS * H]
    w = tl.load(w_ptr + n_row.to(tl.int64) * stride_w + n_head, mask=n_live, other=0.0)
    key_lo, key_hi = tl.min(start), tl.max(end)  # keys some row scores
    lo = tl.minimum(c_lo + tl.maximum(key_lo - col0 - c_lo, 0) // BLOCK * BLOCK, c_end)
    hi = tl.maximum(tl.minimum(c_lo + tl.cdiv(tl.maximum(key_hi - col0 - c_lo, 0), BLOCK) * BLOCK, c_end), lo)
    rows = row.to(tl.int64)
    _minus_inf_tiles(out_ptr, rows, live, c_lo, lo, num_cols, stride_out, BLOCK, ROWS)
    for c in range(lo, hi, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        s = col0 + cols
        wanted = (s >= key_lo) & (s < key_hi)
        k = tl.load(k_ptr + s.to(tl.int64)[:, None] * D + d[None, :], mask=wanted[:, None], other=0.0)
        scale = tl.load(k_scale_ptr + s, mask=wanted, other=0.0)
        dots = tl.dot(k, q, max_num_imprecise_acc=D)  # [BLOCK, ROWS * H]
        heads = tl.reshape(tl.maximum(dots, 0.0) * w[None, :], [BLOCK, ROWS, H])
        score = tl.sum(heads, 2) * scale[:, None]  # [BLOCK, ROWS]
        inside = (s[:, None] >= start[None, :]) & (s[:, None] < end[None, :])
        tl.store(out_ptr + rows[None, :] * stride_out + cols[:, None], tl.where(inside, score, float("-inf")),
                 mask=live[None, :] & (cols < num_cols)[:, None])
    _minus_inf_tiles(out_ptr, rows, live, hi, c_end, num_cols, stride_out, BLOCK, ROWS)


def ragged_logits_into(out: torch.Tensor, q_fp8, weights, k_fp8, k_scale, starts, ends, col0: int = 0, *,
                       rows: int = ROWS_PER_PROGRAM) -> None:
    """Write the logits of key columns ``[col0, col0 + out.shape[1])`` into ``out: [T, c]`` fp32
    (rows may be strided): the ragged kernel over a window of keys, -inf outside each range.
    ``rows``: queries a program scores (a power of two; tests vary it)."""
    num_q, num_heads, _ = q_fp8.shape
    num_cols = out.shape[1]
    if num_q == 0 or num_cols == 0:
        return
    grid = (triton.cdiv(num_q, rows), triton.cdiv(num_cols, BLOCK_S * TILES_PER_PROGRAM))
    _ragged_kernel[grid](
        q_fp8, weights, k_fp8, k_scale, starts, ends, out,
        num_q, num_heads, col0, num_cols, q_fp8.stride(0), weights.stride(0), out.stride(0),
        H=_pad_heads(num_heads), D=INDEX_HEAD_DIM, BLOCK=BLOCK_S, TILES=TILES_PER_PROGRAM, ROWS=rows,
        num_warps=4, num_stages=3,
    )


def indexer_logits(q_fp8, weights, k_fp8, k_scale, starts, ends) -> torch.Tensor:
    """q_fp8: [T, H, 128] e4m3, weights: [T, H] fp32, k_fp8: [S, 128] e4m3, k_scale: [S] fp32,
    starts/ends: [T] int32 -> [T, S] fp32 logits, -inf outside [starts[t], ends[t])."""
    out = torch.empty(q_fp8.shape[0], k_fp8.shape[0], dtype=torch.float32, device=q_fp8.device)
    ragged_logits_into(out, q_fp8.contiguous(), weights.contiguous(), k_fp8.contiguous(), k_scale.contiguous(),
                       starts, ends)
    return out


@triton.jit
def _paged_kernel(q_ptr, w_ptr, cache_ptr, lens_ptr, table_ptr, out_ptr,
                  num_heads, next_n, max_context_len, stride_table,
                  NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, STEPS: tl.constexpr, HEADS_ON_N: tl.constexpr,
                  FILL_PAST_CONTEXT: tl.constexpr):
    """Request b, positions [j * TOKENS * STEPS, (j + 1) * TOKENS * STEPS), TOKENS (whole cache
    blocks, found through the block table) per step; steps past the context only get -inf, and
    only with FILL_PAST_CONTEXT."""
    b = tl.program_id(0).to(tl.int64)
    step0 = tl.program_id(1) * STEPS
    rows = tl.arange(0, NEXT_N * H)  # query j, head h at row j * H + h
    qj = rows // H
    hh = rows % H
    row_ok = (qj < next_n) & (hh < num_heads)
    d = tl.arange(0, D)
    q_row = b * next_n + qj
    q = tl.load(q_ptr + (q_row * num_heads + hh)[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    w = tl.load(w_ptr + q_row * num_heads + hh, mask=row_ok, other=0.0)
    length = tl.load(lens_ptr + b)
    last = length - next_n + tl.arange(0, NEXT_N)  # each query's own position: it sees [0, last]
    out_rows = (b * next_n + tl.arange(0, NEXT_N)).to(tl.int64)[:, None] * max_context_len
    query_ok = (tl.arange(0, NEXT_N) < next_n)[:, None]
    block_bytes = BLOCK_SIZE * (D + 4)
    live_steps = tl.minimum(step0 + STEPS, tl.cdiv(length, TOKENS))  # steps past the context: only -inf
    for step in range(step0, live_steps):
        pos = step * TOKENS + tl.arange(0, TOKENS)
        inside = pos < length
        block = tl.load(table_ptr + b * stride_table + pos // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
        base = cache_ptr + block * block_bytes
        offset = pos % BLOCK_SIZE
        k = tl.load(base[:, None] + offset[:, None] * D + d[None, :], mask=inside[:, None], other=0)
        scale = tl.load((base + BLOCK_SIZE * D).to(tl.pointer_type(tl.float32)) + offset, mask=inside, other=0.0)
        k = k.to(tl.float8e4nv, bitcast=True)
        if HEADS_ON_N:  # tokens on M, heads on N: the head sum stays inside each warp
            dots = tl.dot(k, tl.trans(q), max_num_imprecise_acc=D)
            dots = tl.maximum(dots, 0.0) * w[None, :]  # [TOKENS, NEXT_N * H]
            score = tl.trans(tl.sum(tl.reshape(dots, (TOKENS, NEXT_N, H)), 2)) * scale[None, :]
        else:
            dots = tl.dot(q, tl.trans(k), max_num_imprecise_acc=D)
            dots = tl.maximum(dots, 0.0) * w[:, None]  # [NEXT_N * H, TOKENS]
            score = tl.sum(tl.reshape(dots, (NEXT_N, H, TOKENS)), 1) * scale[None, :]
        score = tl.where(pos[None, :] <= last[:, None], score, float("-inf"))
        tl.store(out_ptr + out_rows + pos[None, :], score, mask=query_ok & (pos < max_context_len)[None, :])
    if FILL_PAST_CONTEXT:
        for step in range(tl.maximum(live_steps, step0), step0 + STEPS):
            pos = step * TOKENS + tl.arange(0, TOKENS)
            tl.store(out_ptr + out_rows + pos[None, :], tl.full([NEXT_N, TOKENS], float("-inf"), tl.float32),
                     mask=query_ok & (pos < max_context_len)[None, :])


def _paged_steps(batch: int, max_context_len: int, tokens: int, device: torch.device) -> int:
    """Steps per program: STEPS_PER_PROGRAM, halved while the grid would not give every SM two
    programs (a decode step of a few requests would otherwise run on a handful of SMs)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    steps, blocks = STEPS_PER_PROGRAM, triton.cdiv(max_context_len, tokens)
    while steps > 1 and batch * triton.cdiv(blocks, steps) < 2 * sms:
        steps //= 2
    return steps


def indexer_logits_paged(q_fp8, weights, k_cache, context_lens, block_tables, max_context_len: int,
                         fill_past_context: bool = True, *, tokens_per_step: int | None = None,
                         steps: int | None = None, num_warps: int = 4, num_stages: int = 3,
                         heads_on_n: bool = True) -> torch.Tensor:
    """q_fp8: [B, n, H, 128] e4m3, weights: [B * n, H] fp32, k_cache: [nb, bs, 1, 132] uint8,
    context_lens: [B] int32, block_tables: [B, max_blocks] int32 -> [B * n, max_context_len] fp32;
    query j of request b sees positions [0, context_lens[b] - n + j], -inf beyond (with
    ``fill_past_context`` False, steps past the context are not written). The keyword knobs set
    the launch (benchmarks sweep them); ``heads_on_n`` puts the tokens on the dot's M dimension
    and the heads on N, so the sum over heads needs no cross-warp step.
    By default 128 tokens a step for up to 2 queries a request, else 64 (from 3 queries the
    [128, n * heads] accumulator spills). H100, b=64 at 128K: 1046 us at the former default (64
    tokens, heads on M), 439 us at this one."""
    batch, next_n, num_heads, _ = q_fp8.shape
    out = torch.empty(batch * next_n, max_context_len, dtype=torch.float32, device=q_fp8.device)
    if out.numel() == 0:
        return out
    block_size = k_cache.shape[1]
    tokens_per_step = tokens_per_step or (128 if next_n <= 2 else 64)
    tokens = max(tokens_per_step, block_size)
    steps = steps or _paged_steps(batch, max_context_len, tokens, q_fp8.device)
    grid = (batch, triton.cdiv(max_context_len, tokens * steps))
    table = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    _paged_kernel[grid](
        q_fp8.contiguous(), weights.contiguous(), k_cache, context_lens, table, out,
        num_heads, next_n, max_context_len, table.stride(0),
        NEXT_N=triton.next_power_of_2(next_n), H=_pad_heads(num_heads), D=INDEX_HEAD_DIM,
        BLOCK_SIZE=block_size, TOKENS=tokens, STEPS=steps, HEADS_ON_N=heads_on_n,
        FILL_PAST_CONTEXT=fill_past_context,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
