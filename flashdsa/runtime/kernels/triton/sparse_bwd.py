"""Sparse MLA backward in Triton: dq and dkv of ``sparse_fwd`` with fp32 accumulation.

One program per (query token, block of up to 64 heads), like the forward. Per step of ``BLOCK_N``
gathered kv rows it recomputes P = exp2(S * log2e * scale - lse * log2e), forms
dS = P (dP - delta) sm_scale with dP = dO V^T and delta = rowsum(dO * O), accumulates
dq += dS K in registers, and produces that step's kv gradient rows dS^T q (+ P^T dO on the 512
value dims). Default: those rows are added with fp32 atomics into a [s_kv, d_qk] buffer.
``deterministic=True``: each (token, head block, slot) row is stored in a scratch buffer instead
(queries processed in chunks that bound it), and a second kernel walks an inverse index (slots
sorted by kv row, stable) so every kv row sums its contributions in one fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.dispatch import interpreting
from flashdsa.runtime.kernels.triton._gather import LOG2E, NOPE, gather_kv, head_blocking, load_heads, mma, to_bf16

SCRATCH_BYTES = 2 << 30  # deterministic mode: bytes of per-slot kv gradients held at once


@triton.jit
def _sparse_bwd_kernel(
    q_ptr, kv_ptr, do_ptr, lse_ptr, delta_ptr, idx_ptr, dq_ptr, dkv_ptr,
    h_q, s_kv, sm_scale, scale_log2, token0,
    stride_qt, stride_qh, stride_kv, stride_dot, stride_doh, stride_it,
    TOPK: tl.constexpr, D_PE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, DETERMINISTIC: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    local = pid // HEAD_BLOCKS  # token within this launch (deterministic mode's scratch row)
    token = token0 + local
    heads = (pid % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < h_q
    q_row = q_ptr + token * stride_qt
    q_nope = load_heads(q_row, heads, head_mask, stride_qh, 0, NOPE)
    q_pe = load_heads(q_row, heads, head_mask, stride_qh, NOPE, D_PE) if D_PE > 0 else q_nope
    do = load_heads(do_ptr + token * stride_dot, heads, head_mask, stride_doh, 0, NOPE)
    stat = token * h_q + heads
    lse2 = tl.load(lse_ptr + stat, mask=head_mask, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + stat, mask=head_mask, other=0.0)
    idx_row = idx_ptr + token * stride_it
    cols = tl.arange(0, NOPE)[None, :]
    cols_pe = NOPE + tl.arange(0, D_PE)[None, :] if D_PE > 0 else cols
    D_QK: tl.constexpr = NOPE + D_PE

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
        dkv_nope = mma(tl.trans(ds), q_nope, None, INTERPRET)
        dkv_nope = mma(tl.trans(to_bf16(p, INTERPRET)), do, dkv_nope, INTERPRET)
        if DETERMINISTIC:  # scratch row of (token in launch, head block, slot)
            dst = dkv_ptr + ((pid * TOPK + start + tl.arange(0, BLOCK_N)) * D_QK)[:, None]
            tl.store(dst + cols, dkv_nope)
        else:
            dst = dkv_ptr + row[:, None] * D_QK
            tl.atomic_add(dst + cols, dkv_nope, mask=valid[:, None], sem="relaxed")
        if D_PE > 0:
            dq_pe = mma(ds, k_pe, dq_pe, INTERPRET)
            dkv_pe = mma(tl.trans(ds), q_pe, None, INTERPRET)
            if DETERMINISTIC:
                tl.store(dst + cols_pe, dkv_pe)
            else:
                tl.atomic_add(dst + cols_pe, dkv_pe, mask=valid[:, None], sem="relaxed")

    dq_row = dq_ptr + token * stride_qt + heads[:, None] * stride_qh
    tl.store(dq_row + cols, to_bf16(dq_nope, INTERPRET), mask=head_mask[:, None])
    if D_PE > 0:
        tl.store(dq_row + cols_pe, to_bf16(dq_pe, INTERPRET), mask=head_mask[:, None])


@triton.jit
def _reduce_rows_kernel(scratch_ptr, order_ptr, bounds_ptr, dkv_ptr,
                        TOPK: tl.constexpr, HEAD_BLOCKS: tl.constexpr, D_QK: tl.constexpr,
                        D_PAD: tl.constexpr):
    """dkv[row] += the scratch rows of the slots that selected ``row``, summed in sorted order."""
    row = tl.program_id(0).to(tl.int64)
    e = tl.load(bounds_ptr + row)
    end = tl.load(bounds_ptr + row + 1)
    cols = tl.arange(0, D_PAD)
    col_mask = cols < D_QK
    acc = tl.zeros([D_PAD], tl.float32)
    while e < end:
        slot = tl.load(order_ptr + e).to(tl.int64)  # local_token * TOPK + k
        base = ((slot // TOPK) * HEAD_BLOCKS * TOPK + slot % TOPK) * D_QK
        for hb in tl.static_range(HEAD_BLOCKS):
            acc += tl.load(scratch_ptr + base + hb * TOPK * D_QK + cols, mask=col_mask, other=0.0)
        e += 1
    dst = dkv_ptr + row * D_QK + cols
    tl.store(dst, tl.load(dst, mask=col_mask) + acc, mask=col_mask)


# keys per step, (num_warps per heads-per-program), pipeline depth; tuned on an H100.
BWD_CONFIG = {"block_n": 32, "warps": {16: 4, 32: 4, 64: 8}, "stages": 1}


def _reduce_deterministic(scratch, idx_chunk, s_kv, dkv32, head_blocks):
    """Add a chunk's scratch rows into ``dkv32`` row by row in (token, slot) order."""
    flat = idx_chunk.reshape(-1).long()
    keys = torch.where((flat >= 0) & (flat < s_kv), flat, s_kv)  # invalid slots sort last
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(sorted_keys, torch.arange(s_kv + 1, device=flat.device))
    d_qk = dkv32.shape[1]
    _reduce_rows_kernel[(s_kv,)](scratch, order, bounds, dkv32, TOPK=idx_chunk.shape[-1],
                                 HEAD_BLOCKS=head_blocks, D_QK=d_qk, D_PAD=triton.next_power_of_2(d_qk))


def sparse_mla_bwd(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                   deterministic: bool = False, *, block_n: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [s_q, h_q, d_qk], dkv [s_kv, 1, d_qk]) in q's dtype, accumulated in fp32.

    q: [s_q, h_q, 512 or 576] bf16, kv: [s_kv, 1, d_qk] bf16, out/dout: [s_q, h_q, 512] bf16,
    lse: [s_q, h_q] fp32 (natural log, +inf on empty rows), indices: [s_q, 1, topk] int32
    (validated by the caller). ``deterministic`` gives bitwise-identical dkv run to run.
    The keyword knobs exist for the benchmark's sweep.
    """
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    assert d_v == 512 and d_qk in (512, 576), "the triton sparse backward serves d_v 512, d_qk 512/576"
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(s_kv, d_qk, dtype=torch.float32, device=q.device)
    if s_q == 0 or s_kv == 0:
        return dq.zero_(), dkv32.to(kv.dtype).unsqueeze(1)
    block_h, head_blocks = head_blocking(h_q)
    delta = (out.float() * dout.float()).sum(-1)  # [s_q, h_q] fp32
    kv2, idx2 = kv.view(s_kv, d_qk), indices.view(s_q, topk)
    chunk = s_q
    if deterministic:
        chunk = max(1, min(s_q, SCRATCH_BYTES // (head_blocks * topk * d_qk * 4)))
        scratch = torch.empty(chunk * head_blocks * topk, d_qk, dtype=torch.float32, device=q.device)
    for token0 in range(0, s_q, chunk):
        n = min(chunk, s_q - token0)
        _sparse_bwd_kernel[(n * head_blocks,)](
            q, kv2, dout, lse, delta, idx2, dq, scratch if deterministic else dkv32,
            h_q, s_kv, sm_scale, sm_scale * LOG2E, token0,
            q.stride(0), q.stride(1), kv2.stride(0), dout.stride(0), dout.stride(1), idx2.stride(0),
            TOPK=topk, D_PE=d_qk - 512, BLOCK_H=block_h, BLOCK_N=block_n or BWD_CONFIG["block_n"],
            HEAD_BLOCKS=head_blocks, DETERMINISTIC=deterministic, INTERPRET=interpreting(),
            num_warps=num_warps or BWD_CONFIG["warps"][block_h],
            num_stages=num_stages or BWD_CONFIG["stages"],
        )
        if deterministic:
            _reduce_deterministic(scratch, idx2[token0:token0 + n], s_kv, dkv32, head_blocks)
    return dq, dkv32.to(kv.dtype).unsqueeze(1)
