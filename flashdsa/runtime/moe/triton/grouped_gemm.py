"""Grouped expert GEMM in Triton: one launch multiplies every block of aligned rows by its expert.

Program (block, column tile) reads the block's expert from ``block_experts`` and exits at once
for an unused block (-1), so the grid can cover the static :func:`max_blocks` bound. Its rows
are activations gathered by token (``pair // top_k``) in the gate/up GEMM (``GATED``) or taken
in aligned order in the down GEMM; padding rows (-1) load zeros. ``GATED`` runs the gate and up
rows of the stacked ``[E, 2n, K]`` weight as two accumulators and stores ``silu(gate) * up``
(``CLIP``: ``silu(min(gate, L)) * clamp(up, -L, L)``, DeepSeek-V4's clipped SwiGLU);
``WEIGHTED`` scales each row by its pair's routing weight and stores it at the pair's row.

FP8 operands (e4m3) carry fp32 scales per token and 128 channels (activations) and per 128x128
block (weights): each BLOCK_K step (BLOCK_K divides 128) adds its dot times both scales to the
fp32 accumulator. On SM90 an FP8 dot adds inside its step with reduced precision and is promoted
to fp32 once per step, as DeepGEMM promotes once per 128.

FP4 weights (``FP4``: DeepSeek-V4's routed experts, ``runtime.fp4``) are packed e2m1 pairs
``[E, N, K/2]`` uint8 with one power-of-two scale per 32 inputs ``[E, N, K/32]`` (UE8M0 exponent
bytes, or fp32). With UE8M0 bytes on a GPU that is the OCP microscaling (MXFP4) layout, and each K
step is one ``tl.dot_scaled`` (bf16 activations, e2m1 weights), whose upcast the compiler places
in the dot's operand layout. Otherwise (fp32 scales, or the CPU interpreter, which has no
``dot_scaled``) a K step walks its scale groups: each group's 16 packed bytes a weight row give
the even inputs' weights (low nibbles) and the odd ones' (high nibbles), turned into exact bf16
by bit arithmetic and multiplied by the bf16 activations at even and odd columns (two dots), and
the group's partial sum is scaled by its row's scale, as FP8 scales its steps. So no tile is
interleaved or reshaped in registers, and a decode step reads a quarter of the bf16 weight bytes.

Program ids walk ``GROUP_M`` blocks down one column tile before the next tile, so a group's
activations and an expert's weight tile are reused from L2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from flashdsa.runtime.dispatch import interpreting
from flashdsa.runtime.fp4 import FP4_GROUP
from flashdsa.runtime.moe.alignment import AlignedPairs

SCALE_GROUP = 128  # rows and columns per weight-scale block, columns per activation scale


@dataclass(frozen=True)
class Tile:
    """Launch shape of one grouped GEMM (the row block, block_m, is the alignment's)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


@triton.jit
def _load_weight_tile(w_base, w_scale_base, rows, row_ok, ks, k_ok, k0, stride_row, stride_scale_row,
                      FP8: tl.constexpr, SCALE_GROUP: tl.constexpr):
    """Weight rows ``rows`` x columns ``ks`` and, for FP8, each row's scale of this 128-column group."""
    w = tl.load(w_base + rows.to(tl.int64)[:, None] * stride_row + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0)
    scale = 1.0
    if FP8:
        scale = tl.load(w_scale_base + (rows // SCALE_GROUP) * stride_scale_row + k0 // SCALE_GROUP, mask=row_ok,
                        other=0.0)
    return w, scale


@triton.jit
def _e2m1_to_bf16(nibble):
    """e2m1 codes (int32 0..15: sign bit 3, then 2 exponent bits and 1 mantissa bit) as their exact
    bf16 values, built as bf16 bits: codes 2..7 (1, 1.5, 2, 3, 4, 6) are ``(code + 252) << 6``
    (exponent field 127 + code // 2 - 1, the mantissa bit on top), code 1 (0.5) is 0x3F00."""
    code = nibble & 7
    bits = tl.where(code < 2, code * 0x3F00, (code + 252) << 6) | ((nibble & 8) << 12)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp4_group_dot(a_even, a_odd, w_base, w_scale_base, rows, row_ok, group, stride_row, stride_scale_row,
                   FP4_GROUP: tl.constexpr):
    """``a @ w^T`` over the ``group``-th FP4_GROUP inputs, times each weight row's scale: the packed
    bytes ``[rows, FP4_GROUP / 2]`` give the even inputs (low nibbles, times ``a_even``) and the odd
    ones (high nibbles, times ``a_odd``), so no tile is interleaved or reshaped in registers."""
    cols = group * (FP4_GROUP // 2) + tl.arange(0, FP4_GROUP // 2)
    packed = tl.load(w_base + rows.to(tl.int64)[:, None] * stride_row + cols[None, :], mask=row_ok[:, None],
                     other=0).to(tl.int32)
    part = tl.dot(a_even, tl.trans(_e2m1_to_bf16(packed & 0xF)))
    part = tl.dot(a_odd, tl.trans(_e2m1_to_bf16(packed >> 4)), part)
    scale = tl.load(w_scale_base + rows.to(tl.int64) * stride_scale_row + group, mask=row_ok, other=0)
    if w_scale_base.dtype.element_ty == tl.uint8:  # UE8M0: the exponent byte, bias 127
        scale = tl.exp2(scale.to(tl.float32) - 127.0)
    return part * scale[None, :]


@triton.jit
def _fp4_scaled_dot(acc, a, w_base, w_scale_base, rows, row_ok, k0, k, stride_row, stride_scale_row,
                    BLOCK_K: tl.constexpr, FP4_GROUP: tl.constexpr):
    """``acc + a @ w^T`` over inputs ``[k0, k0 + BLOCK_K)`` with ``tl.dot_scaled``: the packed bytes
    are e2m1 pairs, first value in the low nibble, and the UE8M0 bytes its e8m0 scales, exactly
    the OCP microscaling layout, so the compiler upcasts the weight in the dot's own operand layout."""
    cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_base + rows.to(tl.int64)[:, None] * stride_row + cols[None, :],
                     mask=row_ok[:, None] & (cols < k // 2)[None, :], other=0)
    groups = k0 // FP4_GROUP + tl.arange(0, BLOCK_K // FP4_GROUP)
    scale = tl.load(w_scale_base + rows.to(tl.int64)[:, None] * stride_scale_row + groups[None, :],
                    mask=row_ok[:, None] & (groups < k // FP4_GROUP)[None, :], other=0)
    return tl.dot_scaled(a, None, "bf16", tl.trans(packed), scale, "e2m1", acc)


@triton.jit
def _accumulate(acc, a, a_scale, w_base, w_scale_base, rows, row_ok, ks, k_ok, k0, k, stride_row, stride_scale_row,
                FP8: tl.constexpr, FP4: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_GROUP: tl.constexpr,
                FP4_GROUP: tl.constexpr):
    """acc + a @ w^T over this K step for weight rows ``rows``: FP4 through ``tl.dot_scaled``; FP8
    products scaled by the row (token) and column (weight row) scales; bf16 as they are."""
    if FP4:  # constexpr branches, not early returns: Triton would still compile what follows
        acc = _fp4_scaled_dot(acc, a, w_base, w_scale_base, rows, row_ok, k0, k, stride_row, stride_scale_row,
                              BLOCK_K, FP4_GROUP)
    else:
        w, w_scale = _load_weight_tile(w_base, w_scale_base, rows, row_ok, ks, k_ok, k0, stride_row,
                                       stride_scale_row, FP8, SCALE_GROUP)
        if FP8:
            acc = acc + tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale[None, :])
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, route_weights_ptr,
    n, k, num_blocks, top_k, swiglu_limit,
    stride_a, stride_a_scale, stride_w_expert, stride_w_row, stride_scale_expert, stride_scale_row, stride_out,
    GATED: tl.constexpr, CLIP: tl.constexpr, WEIGHTED: tl.constexpr, FP8: tl.constexpr, FP4: tl.constexpr,
    SCALED_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_GROUP: tl.constexpr, FP4_GROUP: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile: aligned block ``block`` times column tile ``tile_n`` of
    its expert's weight (``n`` output columns, gate and up each when GATED; ``k`` inputs, which
    FP4 packs two a byte)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first, GROUP_M)
    block = first + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    live = pairs >= 0
    if GATED:  # the gate/up GEMM gathers each pair's token
        a_rows = tl.where(live, pairs // top_k, 0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_base = w_ptr + expert.to(tl.int64) * stride_w_expert
    w_scale_base = w_scale_ptr + expert.to(tl.int64) * stride_scale_expert
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # unused unless GATED (the compiler drops it)
    for k0 in range(0, k, BLOCK_K):
        if FP4 and not SCALED_DOT:  # group by group: even and odd inputs against the low and high nibbles
            for g in tl.static_range(BLOCK_K // FP4_GROUP):
                group = k0 // FP4_GROUP + g
                in_k = group * FP4_GROUP < k  # K is a multiple of FP4_GROUP
                ks = group * FP4_GROUP + 2 * tl.arange(0, FP4_GROUP // 2)
                a_mask = live[:, None] & in_k
                a_even = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=a_mask, other=0.0)
                a_odd = tl.load(a_ptr + a_rows[:, None] * stride_a + 1 + ks[None, :], mask=a_mask, other=0.0)
                acc += _fp4_group_dot(a_even, a_odd, w_base, w_scale_base, cols, col_ok & in_k, group,
                                      stride_w_row, stride_scale_row, FP4_GROUP)
                if GATED:
                    acc_up += _fp4_group_dot(a_even, a_odd, w_base, w_scale_base, n + cols, col_ok & in_k,
                                             group, stride_w_row, stride_scale_row, FP4_GROUP)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=live[:, None] & k_ok[None, :],
                        other=0.0)
            a_scale = 1.0
            if FP8:
                a_scale = tl.load(a_scale_ptr + a_rows * stride_a_scale + k0 // SCALE_GROUP, mask=live, other=0.0)
            acc = _accumulate(acc, a, a_scale, w_base, w_scale_base, cols, col_ok, ks, k_ok, k0, k, stride_w_row,
                              stride_scale_row, FP8, FP4, BLOCK_K, SCALE_GROUP, FP4_GROUP)
            if GATED:
                acc_up = _accumulate(acc_up, a, a_scale, w_base, w_scale_base, n + cols, col_ok, ks, k_ok, k0, k,
                                     stride_w_row, stride_scale_row, FP8, FP4, BLOCK_K, SCALE_GROUP, FP4_GROUP)
    if GATED:
        if CLIP:
            acc = tl.minimum(acc, swiglu_limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
        acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:  # the pair's row of the output, scaled by its routing weight
        acc = acc * tl.load(route_weights_ptr + pairs, mask=live, other=0.0)[:, None]
        out_rows = pairs
        store = live[:, None] & col_ok[None, :]
    else:  # the aligned row; padding rows get zeros, so every row of a used block is written
        out_rows = rows
        store = col_ok[None, :]
    out = out_ptr + out_rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=store)


def grouped_gemm(a: torch.Tensor, a_scale: Optional[torch.Tensor], w: torch.Tensor, w_scale: Optional[torch.Tensor],
                 out: torch.Tensor, aligned: AlignedPairs, top_k: int, tile: Tile, *, gated: bool,
                 route_weights: Optional[torch.Tensor] = None, swiglu_limit: Optional[float] = None) -> None:
    """Write ``out`` from every used block of ``aligned`` (block_m = len(sorted_pairs) / len(block_experts)).

    a: [T, K] (gathered by token: the gate/up GEMM, ``gated``) or [rows, K] in aligned order (the
    down GEMM, with ``route_weights``: [T * top_k] fp32); bf16, or e4m3 with ``a_scale``
    [., ceil(K/128)] fp32. w: [E, N, K] (``gated``: [E, 2n, K], gate rows then up rows), bf16 or
    e4m3 with ``w_scale`` [E, ceil(N/128), ceil(K/128)], or packed FP4 [E, N, K/2] uint8 with
    ``w_scale`` [E, N, K/32] uint8 (UE8M0 exponents) or fp32 (bf16 ``a``; K a multiple of 32).
    out: [rows, n] in aligned order, or with ``route_weights`` [T * top_k, N] at each pair's row
    (rows of invalid pairs are not written). swiglu_limit: clip gate and up before
    ``silu(gate) * up`` (``gated`` only).
    """
    fp8, fp4 = a_scale is not None, w.dtype == torch.uint8
    num_blocks = aligned.block_experts.numel()
    block_m = aligned.sorted_pairs.numel() // max(num_blocks, 1)
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2] * (2 if fp4 else 1)
    if num_blocks == 0:
        return
    assert not fp8 or SCALE_GROUP % tile.block_k == 0, f"FP8 needs block_k dividing {SCALE_GROUP}, got {tile.block_k}"
    assert not fp4 or tile.block_k % FP4_GROUP == 0, f"FP4 needs block_k a multiple of {FP4_GROUP}, got {tile.block_k}"
    weighted, scaled = route_weights is not None, fp8 or fp4
    assert gated or swiglu_limit is None, "swiglu_limit clips the gated GEMM's epilogue only"
    grid = (num_blocks * triton.cdiv(n, tile.block_n),)
    _grouped_gemm_kernel[grid](
        a, a_scale if fp8 else a, w, w_scale if scaled else w, out, aligned.sorted_pairs, aligned.block_experts,
        route_weights if weighted else out, n, k, num_blocks, top_k, 0.0 if swiglu_limit is None else swiglu_limit,
        a.stride(0), a_scale.stride(0) if fp8 else 0, w.stride(0), w.stride(1),
        w_scale.stride(0) if scaled else 0, w_scale.stride(1) if scaled else 0, out.stride(0),
        GATED=gated, CLIP=swiglu_limit is not None, WEIGHTED=weighted, FP8=fp8, FP4=fp4,
        SCALED_DOT=fp4 and w_scale.dtype == torch.uint8 and not interpreting(), BLOCK_M=block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m, SCALE_GROUP=SCALE_GROUP,
        FP4_GROUP=FP4_GROUP, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
