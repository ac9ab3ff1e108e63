"""Indexer logits in Triton with FP8 tensor-core dots (ragged prefill ranges and paged decode).

``score[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q_fp8[t, h] . k_fp8[s])``: one program
takes one query (all its heads as the M dim of an e4m3 ``tl.dot``) and a run of key tiles, so the
query is loaded once and every key tile is read straight from the FP8 store. The paged kernel
reads whole 64-token blocks of the indexer pool through the block table (one or more per step,
masked past the context, so table entries beyond it are never used), with the n query tokens
of a request stacked along M so a block is read once for all of them. Accumulation is fp32; on
SM90 the FP8 tensor cores add inside one 32-deep step with reduced precision, so the dots are
promoted to fp32 every 32 (``max_num_imprecise_acc``), as DeepGEMM does per 128.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.cache.layout import INDEX_HEAD_DIM

BLOCK_S = 128  # keys per dot in the ragged kernel
TILES_PER_PROGRAM = 8  # key tiles one ragged program walks
STEPS_PER_PROGRAM = 16  # steps of whole cache blocks one paged program walks


def _pad_heads(num_heads: int) -> int:
    return max(16, triton.next_power_of_2(num_heads))


@triton.jit
def _head_sum(q, w, k_fp8):
    """``sum_h w[h] * relu(q[h] . k[s])`` for ``q: [H, D]``, ``w: [H]``, ``k_fp8: [S, D]`` -> [S]."""
    dots = tl.dot(q, tl.trans(k_fp8), max_num_imprecise_acc=32)
    return tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0)


@triton.jit
def _ragged_kernel(q_ptr, w_ptr, k_ptr, k_scale_ptr, starts_ptr, ends_ptr, out_ptr,
                   num_heads, num_keys, col0, num_cols, stride_q, stride_w, stride_out,
                   H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Row t, key columns [col0 + j * BLOCK * TILES, ...) of the window [col0, col0 + num_cols)."""
    t = tl.program_id(0).to(tl.int64)
    c_lo = tl.program_id(1) * BLOCK * TILES
    h = tl.arange(0, H)
    d = tl.arange(0, D)
    start = tl.load(starts_ptr + t)
    end = tl.load(ends_ptr + t)
    q = tl.load(q_ptr + t * stride_q + h[:, None] * D + d[None, :], mask=(h < num_heads)[:, None], other=0.0)
    w = tl.load(w_ptr + t * stride_w + h, mask=h < num_heads, other=0.0)
    for c in range(c_lo, c_lo + BLOCK * TILES, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        s = col0 + cols
        inside = (s >= start) & (s < end)
        if (col0 + c < end) & (col0 + c + BLOCK > start):
            k = tl.load(k_ptr + s.to(tl.int64)[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            scale = tl.load(k_scale_ptr + s, mask=inside, other=0.0)
            score = tl.where(inside, _head_sum(q, w, k) * scale, float("-inf"))
        else:
            score = tl.full([BLOCK], float("-inf"), tl.float32)
        tl.store(out_ptr + t * stride_out + cols, score, mask=cols < num_cols)


def ragged_logits_into(out: torch.Tensor, q_fp8, weights, k_fp8, k_scale, starts, ends, col0: int = 0) -> None:
    """Write the logits of key columns ``[col0, col0 + out.shape[1])`` into ``out: [T, c]`` fp32
    (rows may be strided): the ragged kernel over a window of keys, -inf outside each range."""
    num_q, num_heads, _ = q_fp8.shape
    num_cols = out.shape[1]
    if num_q == 0 or num_cols == 0:
        return
    grid = (num_q, triton.cdiv(num_cols, BLOCK_S * TILES_PER_PROGRAM))
    _ragged_kernel[grid](
        q_fp8, weights, k_fp8, k_scale, starts, ends, out,
        num_heads, k_fp8.shape[0], col0, num_cols, q_fp8.stride(0), weights.stride(0), out.stride(0),
        H=_pad_heads(num_heads), D=INDEX_HEAD_DIM, BLOCK=BLOCK_S, TILES=TILES_PER_PROGRAM, num_warps=4,
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
                  BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, STEPS: tl.constexpr, HEADS_ON_N: tl.constexpr):
    """Request b, positions [j * TOKENS * STEPS, (j + 1) * TOKENS * STEPS), TOKENS (whole cache
    blocks, found through the block table) per step."""
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
    for step in range(step0, step0 + STEPS):
        pos = step * TOKENS + tl.arange(0, TOKENS)
        if step * TOKENS < length:
            inside = pos < length
            block = tl.load(table_ptr + b * stride_table + pos // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
            base = cache_ptr + block * block_bytes
            offset = pos % BLOCK_SIZE
            k = tl.load(base[:, None] + offset[:, None] * D + d[None, :], mask=inside[:, None], other=0)
            scale = tl.load((base + BLOCK_SIZE * D).to(tl.pointer_type(tl.float32)) + offset, mask=inside, other=0.0)
            k = k.to(tl.float8e4nv, bitcast=True)
            if HEADS_ON_N:  # tokens on M, heads on N: the head sum stays inside each warp
                dots = tl.dot(k, tl.trans(q), max_num_imprecise_acc=32)
                dots = tl.maximum(dots, 0.0) * w[None, :]  # [TOKENS, NEXT_N * H]
                score = tl.trans(tl.sum(tl.reshape(dots, (TOKENS, NEXT_N, H)), 2)) * scale[None, :]
            else:
                dots = tl.dot(q, tl.trans(k), max_num_imprecise_acc=32)
                dots = tl.maximum(dots, 0.0) * w[:, None]  # [NEXT_N * H, TOKENS]
                score = tl.sum(tl.reshape(dots, (NEXT_N, H, TOKENS)), 1) * scale[None, :]
            score = tl.where(pos[None, :] <= last[:, None], score, float("-inf"))
        else:
            score = tl.full([NEXT_N, TOKENS], float("-inf"), tl.float32)
        tl.store(out_ptr + out_rows + pos[None, :], score, mask=query_ok & (pos < max_context_len)[None, :])


def _paged_steps(batch: int, max_context_len: int, tokens: int, device: torch.device) -> int:
    """Steps per program: STEPS_PER_PROGRAM, halved while the grid would not give every SM two
    programs (a decode step of a few requests would otherwise run on a handful of SMs)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    steps, blocks = STEPS_PER_PROGRAM, triton.cdiv(max_context_len, tokens)
    while steps > 1 and batch * triton.cdiv(blocks, steps) < 2 * sms:
        steps //= 2
    return steps


def indexer_logits_paged(q_fp8, weights, k_cache, context_lens, block_tables, max_context_len: int, *,
                         tokens_per_step: int = 64, steps: int | None = None, num_warps: int = 4,
                         num_stages: int = 3, heads_on_n: bool = False) -> torch.Tensor:
    """q_fp8: [B, n, H, 128] e4m3, weights: [B * n, H] fp32, k_cache: [nb, bs, 1, 132] uint8,
    context_lens: [B] int32, block_tables: [B, max_blocks] int32 -> [B * n, max_context_len] fp32;
    query j of request b sees positions [0, context_lens[b] - n + j], -inf beyond.
    The keyword knobs set the launch (benchmarks sweep them); ``heads_on_n`` puts the tokens on
    the dot's M dimension and the heads on N, so the sum over heads needs no cross-warp step."""
    batch, next_n, num_heads, _ = q_fp8.shape
    out = torch.empty(batch * next_n, max_context_len, dtype=torch.float32, device=q_fp8.device)
    if out.numel() == 0:
        return out
    block_size = k_cache.shape[1]
    tokens = max(tokens_per_step, block_size)
    steps = steps or _paged_steps(batch, max_context_len, tokens, q_fp8.device)
    grid = (batch, triton.cdiv(max_context_len, tokens * steps))
    table = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    _paged_kernel[grid](
        q_fp8.contiguous(), weights.contiguous(), k_cache, context_lens, table, out,
        num_heads, next_n, max_context_len, table.stride(0),
        NEXT_N=triton.next_power_of_2(next_n), H=_pad_heads(num_heads), D=INDEX_HEAD_DIM,
        BLOCK_SIZE=block_size, TOKENS=tokens, STEPS=steps, HEADS_ON_N=heads_on_n,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
