"""Sparse MLA decode over the FP8 paged cache (656 B/token), in Triton.

Each program takes one query token (a row of ``b * s_q``), a block of up to 64 heads and one
split of the top-k list. It gathers ``BLOCK_N`` selected tokens at a time by slot id and runs the
scores and ``P @ V`` (V = the latent) as bf16 tensor core dots with an online softmax in fp32.

By default (``DecodeConfig.prescaled_keys``) each gathered latent is dequantized straight to
bf16(e4m3 * scale), as FlashMLA does: the keys are rounded once to bf16 (relative error <= 2^-9;
at FlashMLA's 1/10-scaled test inputs the lse moves ~3e-6, far inside its tolerance, at unscaled
inputs ~1e-3). The scores are then one 512-wide dot plus the RoPE dot, P is cast to bf16 once, and
``P @ V`` is one [BLOCK_H, BLOCK_N] x [BLOCK_N, 512] dot into one accumulator: no spills at 8
warps. ``prefetch_slots`` loads the next step's slot ids a step ahead, so the gather no longer
waits on an id loaded in the same step and 3 stages double-buffer it. On an H200 (b=128, s_q=2,
h_q=128, topk=2048) this runs at 209 TFLOPS.

``prescaled_keys=False`` keeps the keys exact: the four 128-wide e4m3 tiles become bf16 without
rounding, each tile's fp32 scale multiplies its fp32 partial scores and P before its
``P @ V_tile`` dot (only P is rounded, to bf16). Four dots and accumulators each way spill at 8
warps: 119 TFLOPS on the same shape.

Invalid slots (< 0 or >= num_blocks * block_size) are masked before any load. For small batches
the top-k list is split over several programs that write partial (out, lse) in fp32; a second
kernel merges them (split-KV + combine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from flashdsa.runtime.cache.layout import (
    D_QK,
    KV_LORA_RANK,
    MLA_ROPE_OFFSET,
    MLA_SCALE_OFFSET,
    MLA_TILE,
    MLA_TOKEN_BYTES,
    ROPE_DIM,
)

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape: tokens per step, warps, pipeline depth, and how many programs to aim for."""

    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3  # with prefetch_slots: 0.70 ms vs 0.76 at 2 stages (H200, b=128, s_q=2, topk=2048)
    q_in_loop: bool = False  # reload q from L2 every step (q sits in shared memory either way)
    split_dv: bool = False  # two launches, each accumulating half of d_v (QK recomputed, half the registers)
    prescaled_keys: bool = True  # keys rounded once to bf16(e4m3 * scale): one latent dot each way (1.75x faster)
    prefetch_slots: bool = True  # slot ids loaded a step ahead: with 3 stages the gather is double-buffered
    target_programs: int = 2 * 132
    min_tokens_per_split: int = 128


@triton.jit
def _load_q(q_rows, head_ok, dr, TILE: tl.constexpr, PRESCALED: tl.constexpr):
    """q's latent as 4 tiles [BLOCK_H, 128] (for prescaled keys: one [BLOCK_H, 512] tile and three
    unused 0s), then its RoPE part [BLOCK_H, 64]."""
    mask = head_ok[:, None]
    q_pe = tl.load(q_rows + 4 * TILE + dr[None, :], mask=mask, other=0.0)
    if PRESCALED:  # (one return: the compiler checks every return's types, even under a constexpr if)
        q0 = tl.load(q_rows + tl.arange(0, 4 * TILE)[None, :], mask=mask, other=0.0)
        q1, q2, q3 = 0, 0, 0
    else:
        d = tl.arange(0, TILE)
        q0 = tl.load(q_rows + d[None, :], mask=mask, other=0.0)
        q1 = tl.load(q_rows + TILE + d[None, :], mask=mask, other=0.0)
        q2 = tl.load(q_rows + 2 * TILE + d[None, :], mask=mask, other=0.0)
        q3 = tl.load(q_rows + 3 * TILE + d[None, :], mask=mask, other=0.0)
    return q0, q1, q2, q3, q_pe


@triton.jit
def _load_slots(idx_row, n0, end, BLOCK_N: tl.constexpr):
    """The BLOCK_N slot ids from position n0 of one top-k row; -1 past ``end``."""
    pos = n0 + tl.arange(0, BLOCK_N)
    return tl.load(idx_row + pos, mask=pos < end, other=-1)


@triton.jit
def _load_prescaled_latent(kv_u8_ptr, kv_f32_ptr, slot, valid, BLOCK_N: tl.constexpr, TILE: tl.constexpr,
                           TOKEN_BYTES: tl.constexpr, SCALE_OFF: tl.constexpr):
    """The gathered latents [BLOCK_N, 512] as bf16(e4m3 * tile scale), read as [BLOCK_N, 4, 128]."""
    t = tl.arange(0, 4)
    d = tl.arange(0, TILE)
    lat = tl.load(kv_u8_ptr + slot[:, None, None] * TOKEN_BYTES + t[None, :, None] * TILE + d[None, None, :],
                  mask=valid[:, None, None], other=0)
    sc = tl.load(kv_f32_ptr + slot[:, None] * (TOKEN_BYTES // 4) + SCALE_OFF // 4 + t[None, :],
                 mask=valid[:, None], other=0.0)
    lat = lat.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, :, None]
    return tl.reshape(lat.to(tl.bfloat16), (BLOCK_N, 4 * TILE))


@triton.jit
def _decode_partial_kernel(
    q_ptr, kv_u8_ptr, kv_f32_ptr, kv_bf16_ptr, idx_ptr,
    out_ptr, lse_ptr,
    num_slots, h_q, topk, tokens_per_split, s_q, qk_scale_log2,
    stride_q_row, stride_q_h, stride_idx_row,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, Q_IN_LOOP: tl.constexpr,
    V_HALF: tl.constexpr,  # -1: all of d_v; 0 / 1: only latent tiles 0-1 / 2-3 (acc0, acc1)
    PRESCALED: tl.constexpr,  # keys as bf16(e4m3 * scale): one [BLOCK_H, 512] accumulator in acc0
    PREFETCH: tl.constexpr,  # the next step's slot ids are loaded a step ahead (a loop-carried value)
    TILE: tl.constexpr, ROPE: tl.constexpr, TOKEN_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr,
):
    row = tl.program_id(0)
    head0 = tl.program_id(1) * BLOCK_H
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    heads = head0 + tl.arange(0, BLOCK_H)
    head_ok = heads < h_q
    d = tl.arange(0, TILE)
    dr = tl.arange(0, ROPE)
    ACC_W: tl.constexpr = 4 * TILE if PRESCALED else TILE

    q_rows = q_ptr + row.to(tl.int64) * stride_q_row + heads[:, None] * stride_q_h
    q0, q1, q2, q3, q_pe = _load_q(q_rows, head_ok, dr, TILE, PRESCALED)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, ACC_W], tl.float32)
    acc1 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc2 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc3 = tl.zeros([BLOCK_H, TILE], tl.float32)

    start = split * tokens_per_split
    end = start + tokens_per_split
    if end > topk:  # (not tl.minimum: the interpreter cannot loop to a 1-element tensor)
        end = topk
    idx_row = idx_ptr + row.to(tl.int64) * stride_idx_row
    next_slot = _load_slots(idx_row, start, end, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        if PREFETCH:  # the gather then depends only on the loop-carried ids, so it can be pipelined deeper
            slot = next_slot
            next_slot = _load_slots(idx_row, n0 + BLOCK_N, end, BLOCK_N)
        else:
            slot = _load_slots(idx_row, n0, end, BLOCK_N)
        valid = (slot >= 0) & (slot < num_slots)
        slot = tl.where(valid, slot, 0).to(tl.int64)
        if PRESCALED:
            kv = _load_prescaled_latent(kv_u8_ptr, kv_f32_ptr, slot, valid, BLOCK_N, TILE, TOKEN_BYTES, SCALE_OFF)
        else:  # e4m3 -> bf16 is exact; the tile scale multiplies the fp32 dot products instead
            tok = kv_u8_ptr + slot[:, None] * TOKEN_BYTES + d[None, :]
            scales = kv_f32_ptr + slot * (TOKEN_BYTES // 4) + SCALE_OFF // 4
            k0 = tl.load(tok, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            k1 = tl.load(tok + TILE, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            k2 = tl.load(tok + 2 * TILE, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            k3 = tl.load(tok + 3 * TILE, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            sc0 = tl.load(scales, mask=valid, other=0.0)[None, :]
            sc1 = tl.load(scales + 1, mask=valid, other=0.0)[None, :]
            sc2 = tl.load(scales + 2, mask=valid, other=0.0)[None, :]
            sc3 = tl.load(scales + 3, mask=valid, other=0.0)[None, :]
        k_pe = tl.load(kv_bf16_ptr + slot[:, None] * (TOKEN_BYTES // 2) + ROPE_OFF // 2 + dr[None, :],
                       mask=valid[:, None], other=0.0)
        if Q_IN_LOOP:
            q0, q1, q2, q3, q_pe = _load_q(q_rows, head_ok, dr, TILE, PRESCALED)
        s = tl.dot(q_pe, tl.trans(k_pe))
        if PRESCALED:
            s = tl.dot(q0, tl.trans(kv), s)
        else:
            s += tl.dot(q0, tl.trans(k0)) * sc0
            s += tl.dot(q1, tl.trans(k1)) * sc1
            s += tl.dot(q2, tl.trans(k2)) * sc2
            s += tl.dot(q3, tl.trans(k3)) * sc3
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if PRESCALED:
            acc0 = tl.dot(p.to(tl.bfloat16), kv, acc0 * alpha[:, None])
        else:
            if V_HALF == 1:
                va, vb, sa, sb = k2, k3, sc2, sc3
            else:
                va, vb, sa, sb = k0, k1, sc0, sc1
            acc0 = tl.dot((p * sa).to(tl.bfloat16), va, acc0 * alpha[:, None])
            acc1 = tl.dot((p * sb).to(tl.bfloat16), vb, acc1 * alpha[:, None])
            if V_HALF < 0:
                acc2 = tl.dot((p * sc2).to(tl.bfloat16), k2, acc2 * alpha[:, None])
                acc3 = tl.dot((p * sc3).to(tl.bfloat16), k3, acc3 * alpha[:, None])

    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_i)) / 1.4426950408889634)
    if DIRECT:  # one split: final bf16 out [rows, h_q, 512], lse [b, h_q, s_q]
        o_rows = out_ptr + (row.to(tl.int64) * h_q + heads[:, None]) * (4 * TILE)
        lse = tl.where(empty, float("inf"), lse)
        lse_at = lse_ptr + (row // s_q) * h_q * s_q + heads * s_q + row % s_q
        o_ty = out_ptr.dtype.element_ty
    else:  # partials: out fp32 [rows, splits, h_q, 512], lse fp32 [rows, splits, h_q]
        part = row.to(tl.int64) * num_splits + split
        o_rows = out_ptr + (part * h_q + heads[:, None]) * (4 * TILE)
        lse_at = lse_ptr + part * h_q + heads
        o_ty = tl.float32
    if V_HALF <= 0:
        tl.store(lse_at, lse, mask=head_ok)
    col0 = (V_HALF == 1) * (2 * TILE)
    tl.store(o_rows + col0 + tl.arange(0, ACC_W)[None, :], (acc0 * inv_l[:, None]).to(o_ty), mask=head_ok[:, None])
    if not PRESCALED:
        o_rows += d[None, :]
        tl.store(o_rows + col0 + TILE, (acc1 * inv_l[:, None]).to(o_ty), mask=head_ok[:, None])
        if V_HALF < 0:
            tl.store(o_rows + 2 * TILE, (acc2 * inv_l[:, None]).to(o_ty), mask=head_ok[:, None])
            tl.store(o_rows + 3 * TILE, (acc3 * inv_l[:, None]).to(o_ty), mask=head_ok[:, None])


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, sink_ptr, h_q, num_splits, s_q,
    SPLITS: tl.constexpr, D_V: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """Merge the splits of one (row, head): out = sum_s w_s o_s, w_s = exp(lse_s - lse); with
    HAS_SINK (DeepSeek-V4) out is then scaled by exp(lse) / (exp(lse) + exp(sink[head])). The sums
    run split by split, so trailing empty splits (a list padded to a CUDA graph's width) add exact
    zeros and change no bit."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    dv = tl.arange(0, D_V)
    first = row.to(tl.int64) * num_splits
    m = tl.max(tl.load(part_lse_ptr + (first + sp) * h_q + head, mask=sp < num_splits, other=float("-inf")), 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = 0.0
    acc = tl.zeros([D_V], tl.float32)
    for split in range(num_splits):
        w = tl.exp(tl.load(part_lse_ptr + (first + split) * h_q + head) - m_safe)
        o_s = tl.load(part_out_ptr + ((first + split) * h_q + head) * D_V + dv)
        acc += tl.where(w > 0.0, o_s, 0.0) * w  # an empty split may hold 0 * inf
        total += w
    inv = tl.where(total == 0.0, 0.0, 1.0 / total)
    lse = tl.where(total == 0.0, float("inf"), m_safe + tl.log(total))
    if HAS_SINK:
        inv = inv / (1.0 + tl.exp(tl.where(total == 0.0, 0.0, tl.load(sink_ptr + head) - lse)))
    tl.store(out_ptr + (row.to(tl.int64) * h_q + head) * D_V + dv, (acc * inv).to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + (row // s_q) * h_q * s_q + head * s_q + row % s_q, lse)


def _num_splits(rows: int, head_blocks: int, topk: int, config: DecodeConfig) -> int:
    """Enough splits of the top-k list to fill the GPU, none shorter than min_tokens_per_split."""
    programs = rows * head_blocks
    wanted = math.ceil(config.target_programs / programs)
    most = max(1, topk // config.min_tokens_per_split)
    return max(1, min(wanted, most))


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = KV_LORA_RANK,
    *,
    config: Optional[DecodeConfig] = None,
    num_splits: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [b, s_q, h_q, 576] bf16, kv_cache: [num_blocks, block_size, 1, 656] uint8, indices:
    [b, s_q, topk] int32 slot ids -> (out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q] fp32).

    Inputs are validated by the public op; this backend needs d_qk 576 and d_v 512.
    ``num_splits`` forces the split-KV count (tests); by default it follows ``config``.
    """
    if q.shape[-1] != D_QK or d_v != KV_LORA_RANK:
        raise ValueError(f"triton sparse_mla_decode needs d_qk {D_QK} and d_v {KV_LORA_RANK}, "
                         f"got {q.shape[-1]} and {d_v}")
    config = config or DecodeConfig()
    if config.prescaled_keys and config.split_dv:
        raise ValueError("config: prescaled_keys keeps one [heads, 512] accumulator, it cannot split_dv")
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    rows = b * s_q
    q_rows = q.reshape(rows, h_q, D_QK)
    idx = indices.reshape(rows, topk)
    if q_rows.stride(-1) != 1:
        q_rows = q_rows.contiguous()
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    cache = kv_cache.contiguous()
    num_slots = cache.shape[0] * cache.shape[1]
    out = torch.empty(b, s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    if rows == 0 or h_q == 0:
        return out, lse
    block_h = 64 if h_q > 32 else max(16, triton.next_power_of_2(h_q))
    head_blocks = triton.cdiv(h_q, block_h)
    splits = num_splits or _num_splits(rows, head_blocks, topk, config)
    per_split = triton.cdiv(triton.cdiv(max(topk, 1), splits), config.block_n) * config.block_n
    splits = max(1, triton.cdiv(topk, per_split))
    direct = splits == 1
    if direct:
        part_out, part_lse = out, lse
    else:
        part_out = torch.empty(rows, splits, h_q, d_v, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, splits, h_q, dtype=torch.float32, device=q.device)
    for v_half in ((0, 1) if config.split_dv else (-1,)):
        _decode_partial_kernel[(rows, head_blocks, splits)](
            q_rows, cache, cache.view(torch.float32), cache.view(torch.bfloat16), idx,
            part_out, part_lse,
            num_slots, h_q, topk, per_split, s_q, sm_scale * LOG2E,
            q_rows.stride(0), q_rows.stride(1), idx.stride(0),
            BLOCK_H=block_h, BLOCK_N=config.block_n, DIRECT=direct, Q_IN_LOOP=config.q_in_loop, V_HALF=v_half,
            PRESCALED=config.prescaled_keys, PREFETCH=config.prefetch_slots,
            TILE=MLA_TILE, ROPE=ROPE_DIM, TOKEN_BYTES=MLA_TOKEN_BYTES,
            SCALE_OFF=MLA_SCALE_OFFSET, ROPE_OFF=MLA_ROPE_OFFSET,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    if not direct:
        _combine_kernel[(rows, h_q)](
            part_out, part_lse, out, lse, lse, h_q, splits, s_q,
            SPLITS=triton.next_power_of_2(splits), D_V=d_v, HAS_SINK=False, num_warps=4,
        )
    return out, lse
