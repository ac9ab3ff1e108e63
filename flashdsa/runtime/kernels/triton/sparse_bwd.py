"""Sparse MLA backward in Triton: dq and dkv of ``sparse_fwd`` with fp32 accumulation.

Two kernels per chunk of query tokens (the chunk bounds the scratch memory):

1. ``_bwd_dq_kernel``, one program per (token, block of up to 64 heads) like the forward: per
   step of ``BLOCK_N`` gathered kv rows it recomputes P = exp2(S log2e - lse log2e), forms
   dS = P (dP - delta) sm_scale with dP = dO V^T and delta = rowsum(dO * O) (computed here from
   out and dout), accumulates
   dq += dS K in registers and writes P and dS (bf16, ``[tokens, h_q, topk]``) to scratch.
2. ``_bwd_dkv_kernel``, one program per (token, 64 of the d_qk columns): all heads at once,
   dkv rows = dS^T q (+ P^T dO on the 512 value columns), added into an fp32 ``[s_kv, d_qk]``
   buffer with atomics. Splitting the work this way keeps each kernel's operands in shared
   memory (q, dO and a kv tile for the first; a column slice of q and dO for the second).

``deterministic=True``: the second kernel stores each (token, slot) row into scratch instead,
and ``_reduce_rows_kernel`` walks an inverse index (slots stably sorted by kv row), so every kv
row sums its contributions in one fixed order: bitwise-identical dkv run to run.

``run_backward`` drives the chunks with the two steps as functions (``triton_dq``, ``triton_dkv``):
the native backend (``kernels.cuda.sparse_bwd``) runs its own kernels in the same driver.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
import triton.language as tl

from flashdsa.runtime.dispatch import interpreting
from flashdsa.runtime.kernels.triton._gather import LOG2E, NOPE, gather_kv, head_blocking, load_heads, mma, to_bf16

SCRATCH_BYTES = 2 << 30  # P, dS (and deterministic rows) held at once; sets the token chunk
DKV_COLS = 64  # d_qk columns per dkv program (576 = 9 x 64, 512 = 8 x 64)


@triton.jit(do_not_specialize=["h_q", "s_kv", "token0"])
def _bwd_dq_kernel(
    q_ptr, kv_ptr, o_ptr, do_ptr, lse_ptr, idx_ptr, dq_ptr, p_ptr, ds_ptr,
    h_q, s_kv, sm_scale, scale_log2, token0,
    stride_qt, stride_qh, stride_kv, stride_dot, stride_doh, stride_it,  # out shares dout's strides
    TOPK: tl.constexpr, D_PE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    local = pid // HEAD_BLOCKS  # token within the chunk
    token = token0 + local
    heads = (pid % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < h_q
    q_row = q_ptr + token * stride_qt
    q_nope = load_heads(q_row, heads, head_mask, stride_qh, 0, NOPE)
    q_pe = load_heads(q_row, heads, head_mask, stride_qh, NOPE, D_PE) if D_PE > 0 else q_nope
    do = load_heads(do_ptr + token * stride_dot, heads, head_mask, stride_doh, 0, NOPE)
    o = load_heads(o_ptr + token * stride_dot, heads, head_mask, stride_doh, 0, NOPE)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rowsum(dO * O), 0 on padded heads
    lse2 = tl.load(lse_ptr + token * h_q + heads, mask=head_mask, other=float("inf")) * 1.4426950408889634
    idx_row = idx_ptr + token * stride_it
    scratch_rows = ((local * h_q + heads) * TOPK)[:, None]

    dq_nope = tl.zeros([BLOCK_H, NOPE], tl.float32)
    dq_pe = tl.zeros([BLOCK_H, D_PE], tl.float32) if D_PE > 0 else dq_nope
    for start in range(0, TOPK, BLOCK_N):
        valid, row, k_nope, k_pe = gather_kv(kv_ptr, idx_row, start, s_kv, stride_kv, BLOCK_N, D_PE)
        s = mma(q_nope, tl.trans(k_nope), None, INTERPRET)
        if D_PE > 0:
            s = mma(q_pe, tl.trans(k_pe), s, INTERPRET)
        p = tl.where(valid[None, :], tl.math.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        dp = mma(do, tl.trans(k_nope), None, INTERPRET)
        ds = to_bf16(p * (dp - delta[:, None]) * sm_scale, INTERPRET)
        dq_nope = mma(ds, k_nope, dq_nope, INTERPRET)
        if D_PE > 0:
            dq_pe = mma(ds, k_pe, dq_pe, INTERPRET)
        at = scratch_rows + start + tl.arange(0, BLOCK_N)[None, :]
        tl.store(p_ptr + at, to_bf16(p, INTERPRET), mask=head_mask[:, None])
        tl.store(ds_ptr + at, ds, mask=head_mask[:, None])

    dq_row = dq_ptr + token * stride_qt + heads[:, None] * stride_qh
    tl.store(dq_row + tl.arange(0, NOPE)[None, :], to_bf16(dq_nope, INTERPRET), mask=head_mask[:, None])
    if D_PE > 0:
        tl.store(dq_row + NOPE + tl.arange(0, D_PE)[None, :], to_bf16(dq_pe, INTERPRET), mask=head_mask[:, None])


@triton.jit(do_not_specialize=["h_q", "s_kv", "token0"])
def _bwd_dkv_kernel(
    q_ptr, do_ptr, idx_ptr, p_ptr, ds_ptr, dkv_ptr,
    h_q, s_kv, token0, stride_qt, stride_qh, stride_dot, stride_doh, stride_it,
    TOPK: tl.constexpr, D_QK: tl.constexpr, H_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    COLS: tl.constexpr, DETERMINISTIC: tl.constexpr, INTERPRET: tl.constexpr,
):
    CHUNKS: tl.constexpr = D_QK // COLS
    pid = tl.program_id(0).to(tl.int64)
    local = pid // CHUNKS
    token = token0 + local
    first_col = (pid % CHUNKS) * COLS
    cols = first_col + tl.arange(0, COLS)
    heads = tl.arange(0, H_PAD)
    head_mask = heads < h_q
    q_c = load_heads(q_ptr + token * stride_qt + first_col, heads, head_mask, stride_qh, 0, COLS)
    is_value = first_col < NOPE  # the first 512 columns are also the value
    do_c = load_heads(do_ptr + token * stride_dot + first_col, heads, head_mask & is_value, stride_doh, 0, COLS)
    idx_row = idx_ptr + token * stride_it
    scratch_rows = ((local * h_q + heads) * TOPK)[:, None]
    for start in range(0, TOPK, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + slots)
        valid = (idx >= 0) & (idx < s_kv)
        ds = tl.load(ds_ptr + scratch_rows + slots[None, :], mask=head_mask[:, None], other=0.0)
        acc = mma(tl.trans(ds), q_c, None, INTERPRET)  # [BLOCK_N, COLS]
        if is_value:
            p = tl.load(p_ptr + scratch_rows + slots[None, :], mask=head_mask[:, None], other=0.0)
            acc = mma(tl.trans(p), do_c, acc, INTERPRET)
        if DETERMINISTIC:  # scratch row of (token in chunk, slot)
            tl.store(dkv_ptr + ((local * TOPK + slots) * D_QK)[:, None] + cols[None, :], acc)
        else:
            dst = dkv_ptr + (tl.where(valid, idx, 0).to(tl.int64) * D_QK)[:, None] + cols[None, :]
            tl.atomic_add(dst, acc, mask=valid[:, None], sem="relaxed")


@triton.jit
def _reduce_rows_kernel(rows_ptr, order_ptr, bounds_ptr, dkv_ptr, D_QK: tl.constexpr, D_PAD: tl.constexpr):
    """dkv[row] += the scratch rows of the slots that selected ``row``, summed in sorted order."""
    row = tl.program_id(0).to(tl.int64)
    e = tl.load(bounds_ptr + row)
    end = tl.load(bounds_ptr + row + 1)
    cols = tl.arange(0, D_PAD)
    col_mask = cols < D_QK
    acc = tl.zeros([D_PAD], tl.float32)
    while e < end:
        slot = tl.load(order_ptr + e).to(tl.int64)  # token in chunk * topk + k
        acc += tl.load(rows_ptr + slot * D_QK + cols, mask=col_mask, other=0.0)
        e += 1
    dst = dkv_ptr + row * D_QK + cols
    tl.store(dst, tl.load(dst, mask=col_mask) + acc, mask=col_mask)


# Keys per step, warps (per heads-per-program) and pipeline depth, from the sweep in
# benchmarks/bench_attention.py on an H200 (s_kv 64K, ms per backward): dq kernel N=64/1 stage
# 39.7, N=32/1 stage 45.0, N=32/4 stages 46.3, 16 warps 75.0; dkv kernel N=64/4 warps 39.6,
# N=128/8 warps 41.4.
DQ_CONFIG = {"block_n": 64, "warps": {16: 4, 32: 4, 64: 8}, "stages": 1}
DKV_CONFIG = {"block_n": 64, "warps": 4, "stages": 3}


# The two steps of a chunk of tokens [token0, token0 + tokens), as functions so that the native
# backend (kernels.cuda.sparse_bwd) can run its own kernels in the same driver (run_backward):
# dq_stage(q, kv [s_kv, d_qk], out, dout, lse, indices [s_q, topk], dq, p, ds, s_kv, sm_scale, token0,
#          tokens): dq of the chunk's rows, and its P and dS in bf16 scratch [tokens, h_q, topk];
# dkv_stage(q, dout, indices, p, ds, rows, s_kv, token0, tokens, deterministic): the dkv rows from
#          that scratch, added into ``rows`` ([s_kv, d_qk] fp32) or, deterministic, stored per
#          (token of the chunk, slot) into it.
DqStage = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                    torch.Tensor, torch.Tensor, int, float, int, int], None]
DkvStage = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int,
                     bool], None]


def triton_dq(q: torch.Tensor, kv2: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
              idx2: torch.Tensor, dq: torch.Tensor, p_buf: torch.Tensor, ds_buf: torch.Tensor, s_kv: int,
              sm_scale: float, token0: int, tokens: int, *, block_n: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> None:
    """The Triton dq step (a ``DqStage``): one program per (token, block of heads); the keyword
    knobs exist for the benchmark's sweep."""
    h_q, d_qk, topk = q.shape[1], q.shape[2], idx2.shape[1]
    block_n = block_n or DQ_CONFIG["block_n"]
    if topk % block_n:  # the kernel's index loads and scratch stores are whole tiles
        raise ValueError(f"triton dq needs topk a multiple of block_n {block_n}, got {topk}")
    block_h, head_blocks = head_blocking(h_q)
    _bwd_dq_kernel[(tokens * head_blocks,)](
        q, kv2, out, dout, lse, idx2, dq, p_buf, ds_buf,
        h_q, s_kv, sm_scale, sm_scale * LOG2E, token0,
        q.stride(0), q.stride(1), kv2.stride(0), dout.stride(0), dout.stride(1), idx2.stride(0),
        TOPK=topk, D_PE=d_qk - NOPE.value, BLOCK_H=block_h, BLOCK_N=block_n,
        HEAD_BLOCKS=head_blocks, INTERPRET=interpreting(), num_warps=num_warps or DQ_CONFIG["warps"][block_h],
        num_stages=num_stages or DQ_CONFIG["stages"],
    )


def triton_dkv(q: torch.Tensor, dout: torch.Tensor, idx2: torch.Tensor, p_buf: torch.Tensor, ds_buf: torch.Tensor,
               rows: torch.Tensor, s_kv: int, token0: int, tokens: int, deterministic: bool) -> None:
    """The Triton dkv step (a ``DkvStage``): one program per (token, 64 of the d_qk columns)."""
    h_q, d_qk, topk = q.shape[1], q.shape[2], idx2.shape[1]
    _bwd_dkv_kernel[(tokens * (d_qk // DKV_COLS),)](
        q, dout, idx2, p_buf, ds_buf, rows,
        h_q, s_kv, token0, q.stride(0), q.stride(1), dout.stride(0), dout.stride(1), idx2.stride(0),
        TOPK=topk, D_QK=d_qk, H_PAD=max(16, triton.next_power_of_2(h_q)), BLOCK_N=DKV_CONFIG["block_n"],
        COLS=DKV_COLS, DETERMINISTIC=deterministic, INTERPRET=interpreting(),
        num_warps=DKV_CONFIG["warps"], num_stages=DKV_CONFIG["stages"],
    )


def _reduce_deterministic(rows: torch.Tensor, idx_chunk: torch.Tensor, dkv32: torch.Tensor) -> None:
    """Add a chunk's per-slot rows into ``dkv32`` kv row by kv row, each in (token, slot) order."""
    s_kv, d_qk = dkv32.shape
    flat = idx_chunk.reshape(-1).long()
    keys = torch.where((flat >= 0) & (flat < s_kv), flat, s_kv)  # invalid slots sort last
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(sorted_keys, torch.arange(s_kv + 1, device=flat.device))
    _reduce_rows_kernel[(s_kv,)](rows, order, bounds, dkv32, D_QK=d_qk, D_PAD=triton.next_power_of_2(d_qk))


def run_backward(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                 indices: torch.Tensor, sm_scale: float, deterministic: bool, dq_stage: DqStage,
                 dkv_stage: DkvStage) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward in chunks of tokens whose P and dS fit SCRATCH_BYTES: per chunk ``dq_stage``,
    ``dkv_stage`` and, deterministic, the fixed-order sum of the per-slot rows. Returns (dq, dkv)."""
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(s_kv, d_qk, dtype=torch.float32, device=q.device)
    if s_q == 0 or s_kv == 0:
        return dq.zero_(), dkv32.to(kv.dtype).unsqueeze(1)
    kv2, idx2 = kv.view(s_kv, d_qk), indices.view(s_q, topk)
    per_token = h_q * topk * 4 + (topk * d_qk * 4 if deterministic else 0)
    chunk = max(1, min(s_q, SCRATCH_BYTES // per_token))
    p_buf = torch.empty(chunk * h_q * topk, dtype=q.dtype, device=q.device)
    ds_buf = torch.empty_like(p_buf)
    rows = torch.empty(chunk * topk, d_qk, dtype=torch.float32, device=q.device) if deterministic else dkv32
    for token0 in range(0, s_q, chunk):
        n = min(chunk, s_q - token0)
        dq_stage(q, kv2, out, dout, lse, idx2, dq, p_buf, ds_buf, s_kv, sm_scale, token0, n)
        dkv_stage(q, dout, idx2, p_buf, ds_buf, rows, s_kv, token0, n, deterministic)
        if deterministic:
            _reduce_deterministic(rows, idx2[token0:token0 + n], dkv32)
    return dq, dkv32.to(kv.dtype).unsqueeze(1)


def sparse_mla_bwd(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                   deterministic: bool = False, *, block_n: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [s_q, h_q, d_qk], dkv [s_kv, 1, d_qk]) in q's dtype, accumulated in fp32.

    q: [s_q, h_q, 512 or 576] bf16, kv: [s_kv, 1, d_qk] bf16, out/dout: [s_q, h_q, 512] bf16,
    lse: [s_q, h_q] fp32 (natural log, +inf on empty rows), indices: [s_q, 1, topk] int32
    (validated by the caller). ``deterministic`` gives bitwise-identical dkv run to run.
    The keyword knobs (dq kernel) exist for the benchmark's sweep.
    """
    assert d_v == 512 and q.shape[-1] in (512, 576), "the triton sparse backward serves d_v 512, d_qk 512/576"
    assert out.stride() == dout.stride(), "out and dout must share strides (both contiguous)"
    dq_stage = functools.partial(triton_dq, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    return run_backward(q, kv, out, dout, lse, indices, sm_scale, deterministic, dq_stage, triton_dkv)
