"""Sparse MLA prefill forward in Triton: each query attends to its own top-k kv rows.

One program per (query token, block of up to 64 heads), grid axis 0 = s_q * head blocks (no grid
overflow up to s_q of millions). Per step it gathers ``BLOCK_N`` kv rows, computes the scores as
q_nope @ k_nope^T + q_pe @ k_pe^T (512 + 64 dims keep the tiles powers of two), and updates an
online softmax in base 2; the 512 latent dims of the same tile are the values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.dispatch import interpreting
from flashdsa.runtime.kernels.triton._gather import (
    LOG2E, NOPE, gather_kv, head_blocking, load_heads, mma, softmax_step, to_bf16,
)

LN2 = tl.constexpr(0.6931471805599453)  # natural log of 2, readable inside the kernel


@triton.jit(do_not_specialize=["h_q", "s_kv"])
def _sparse_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, max_logits_ptr, lse_ptr,
    h_q, s_kv, scale_log2,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
    TOPK: tl.constexpr, D_PE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    token = pid // HEAD_BLOCKS
    heads = (pid % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < h_q
    q_row = q_ptr + token * stride_qt
    q_nope = load_heads(q_row, heads, head_mask, stride_qh, 0, NOPE)
    q_pe = load_heads(q_row, heads, head_mask, stride_qh, NOPE, D_PE) if D_PE > 0 else q_nope
    idx_row = idx_ptr + token * stride_it

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, base-2 scaled units
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, NOPE], tl.float32)
    for start in range(0, TOPK, BLOCK_N):
        valid, row, k_nope, k_pe = gather_kv(kv_ptr, idx_row, start, s_kv, stride_kv, BLOCK_N, D_PE)
        s = mma(q_nope, tl.trans(k_nope), None, INTERPRET)
        if D_PE > 0:
            s = mma(q_pe, tl.trans(k_pe), s, INTERPRET)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m, l, acc = softmax_step(s, m, l, acc, k_nope, INTERPRET)

    has_any = l > 0.0
    out = acc / tl.where(has_any, l, 1.0)[:, None]
    o_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + tl.arange(0, NOPE)[None, :]
    tl.store(o_ptrs, to_bf16(out, INTERPRET), mask=head_mask[:, None])
    lse = tl.where(has_any, (m + tl.math.log2(tl.where(has_any, l, 1.0))) * LN2, float("inf"))
    stat = token * h_q + heads
    tl.store(lse_ptr + stat, lse, mask=head_mask)
    tl.store(max_logits_ptr + stat, m * LN2, mask=head_mask)


# Keys per step, warps (per heads-per-program) and pipeline depth, from the sweep in
# benchmarks/bench_attention.py on an H200 (s_kv 64K, ms per forward): N=64 with 4 stages 9.43,
# 2 stages 10.33, 1 stage 18.1; N=32 with 8 stages 12.2; 16 warps 21.9. The gathered kv tile is an
# indirect load, so Triton gives it 2 buffers whatever the depth (Q 72 KiB + 2 x 72 KiB of kv);
# the extra stages prefetch the indices.
FWD_CONFIG = {"block_n": 64, "warps": {16: 4, 32: 4, 64: 8}, "stages": 4}


def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                   d_v: int = 512, *, block_n: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out [s_q, h_q, 512] (q's dtype), max_logits, lse [s_q, h_q] fp32 (natural log, scaled scores).

    q: [s_q, h_q, 512 or 576] bf16, kv: [s_kv, 1, d_qk] bf16, indices: [s_q, 1, topk] int32 (inputs
    validated by the caller; d_v must be 512, topk a multiple of 64). A row with no valid index
    gives out 0, lse +inf, max_logits -inf. The keyword knobs exist for the benchmark's sweep.
    """
    s_q, h_q, d_qk = q.shape
    assert d_v == 512 and d_qk in (512, 576), "the triton sparse forward serves d_v 512, d_qk 512/576"
    out = torch.empty(s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    if s_q == 0 or h_q == 0:
        return out, max_logits, lse
    block_h, head_blocks = head_blocking(h_q)
    kv2 = kv.view(kv.shape[0], d_qk)
    idx2 = indices.view(s_q, indices.shape[-1])
    _sparse_fwd_kernel[(s_q * head_blocks,)](
        q, kv2, idx2, out, max_logits, lse,
        h_q, kv.shape[0], sm_scale * LOG2E,
        q.stride(0), q.stride(1), kv2.stride(0), idx2.stride(0), out.stride(0), out.stride(1),
        TOPK=idx2.shape[1], D_PE=d_qk - 512, BLOCK_H=block_h, BLOCK_N=block_n or FWD_CONFIG["block_n"],
        HEAD_BLOCKS=head_blocks, INTERPRET=interpreting(),
        num_warps=num_warps or FWD_CONFIG["warps"][block_h],
        num_stages=num_stages or FWD_CONFIG["stages"],
    )
    return out, max_logits, lse
