"""Decode-shaped FP4 expert GEMM in Triton: CUDA-core FMAs over each chosen expert's packed weights.

At decode an expert holds one or two (token, slot) pairs, so the grouped GEMM's 16-row tensor-core
tiles are mostly padding and the e2m1 upcast in the dot's operand layout costs more than the
bytes. Here program (block, column tile) of the same aligned layout (``runtime.moe.alignment``,
small ``block_m``: 1, 2 or 4 rows) streams its expert's packed tile ``[BLOCK_N, K/2]`` uint8 once,
BLOCK_K inputs a step, and for each of its rows reduces ``sum_k w[n, k] * a[k]`` in fp32 on the
CUDA cores: a step loads the weight bytes as ``[BLOCK_N, BLOCK_K/32, 16]`` (one 16-byte run a
row and scale group, so each thread's loads are 16-byte vectors), turns low and high nibbles into
exact values with grouped_gemm's ``_e2m1_to_bf16`` (no lookup table, no reshape), multiplies them
by the even and odd inputs, sums each group, scales it by its UE8M0 (or fp32) scale and adds it
to the row's accumulator. The unpack is shared by the block's rows; each row costs two FMAs a
weight byte. Gate/up (``GATED``) runs the gate and up rows of the stacked ``[E, 2n, K/2]`` weight
as two accumulators; the epilogue (SwiGLU with the optional clip, or the routing weight and the
pair's row) is grouped_gemm's, so both paths write the same buffers for the same combine.

There is no K split: the gated epilogue needs whole sums, and a split summed by atomics would
not be deterministic; at V4-Flash widths the column tiles alone give hundreds of programs.
Program ids walk the blocks of one column tile before the next tile, so the blocks of an expert
with more pairs than ``block_m`` (adjacent in the layout) read the same tile close in time,
from L2. Unused blocks (expert -1) exit at once: the grid is the static :func:`max_blocks` bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from flashdsa.runtime.fp4 import FP4_GROUP
from flashdsa.runtime.moe.alignment import AlignedPairs
from flashdsa.runtime.moe.triton.grouped_gemm import _e2m1_to_bf16, _store_rows, _tile_setup


@dataclass(frozen=True)
class GemvTile:
    """Launch shape of one FP4 decode GEMM: output columns per program, inputs per K step (a
    multiple of 32: whole scale groups), warps, and the loop's pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


# Launch shapes `bench_moe.py --sweep` times (tests/test_triton_compile.py checks each compiles):
# narrow column tiles spread an expert over many programs; K steps of 256-1024 inputs put 2-8
# 16-byte weight loads per thread (4 warps, 16 rows) in flight; warps and stages trade occupancy.
CANDIDATES = (GemvTile(16, 512, 4, 2), GemvTile(16, 256, 4, 2), GemvTile(16, 1024, 4, 2), GemvTile(8, 1024, 4, 2),
              GemvTile(32, 256, 4, 2), GemvTile(32, 512, 8, 2), GemvTile(64, 256, 8, 2), GemvTile(16, 512, 4, 1),
              GemvTile(16, 512, 4, 3), GemvTile(8, 512, 2, 2), GemvTile(32, 1024, 8, 1), GemvTile(16, 512, 8, 2))


@triton.jit
def _inputs(a_ptr, a_rows, live, stride_a, groups, group_ok, HALF: tl.constexpr):
    """The K step's activations of the block's rows as fp32 ``[BLOCK_M, 1, G, HALF]``, even inputs
    and odd ones (the weights of byte j of a group are inputs 2j and 2j + 1); padding rows are 0."""
    ks = 2 * (groups[:, None] * HALF + tl.arange(0, HALF)[None, :])
    at = a_ptr + a_rows[:, None, None] * stride_a + ks[None, :, :]
    mask = live[:, None, None] & group_ok[None, :, None]
    even = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(at + 1, mask=mask, other=0.0).to(tl.float32)
    return even[:, None, :, :], odd[:, None, :, :]


@triton.jit
def _fp4_rows_dot(a_even, a_odd, w_base, w_scale_base, rows, row_ok, groups, group_ok, stride_row, stride_scale_row,
                  HALF: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` fp32: each activation row times weight rows ``rows`` over the step's
    scale groups ``groups`` (packed bytes ``[rows, G, HALF]``, low nibble the even input), each
    group's sum times its row's scale."""
    cols = groups[:, None] * HALF + tl.arange(0, HALF)[None, :]
    mask = row_ok[:, None, None] & group_ok[None, :, None]
    packed = tl.load(w_base + rows.to(tl.int64)[:, None, None] * stride_row + cols[None, :, :], mask=mask,
                     other=0).to(tl.int32)
    low = _e2m1_to_bf16(packed & 0xF).to(tl.float32)[None, :, :, :]
    high = _e2m1_to_bf16(packed >> 4).to(tl.float32)[None, :, :, :]
    part = tl.sum(low * a_even + high * a_odd, axis=3)  # [BLOCK_M, BLOCK_N, G]
    scale_mask = row_ok[:, None] & group_ok[None, :]
    scale = tl.load(w_scale_base + rows.to(tl.int64)[:, None] * stride_scale_row + groups[None, :], mask=scale_mask,
                    other=0)
    if w_scale_base.dtype.element_ty == tl.uint8:  # UE8M0: the exponent byte, bias 127
        scale = tl.exp2(scale.to(tl.float32) - 127.0)
    return tl.sum(part * scale[None, :, :], axis=2)


@triton.jit
def _fp4_gemv_kernel(
    a_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, route_weights_ptr,
    n, k, num_blocks, top_k, swiglu_limit,
    stride_a, stride_w_expert, stride_w_row, stride_scale_expert, stride_scale_row, stride_out,
    GATED: tl.constexpr, CLIP: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4_GROUP: tl.constexpr,
):
    """Aligned block ``pid % num_blocks`` times column tile ``pid // num_blocks`` of its expert's
    FP4 weight (``n`` output columns, gate and up each when GATED; ``k`` inputs, a multiple of 32)."""
    pid = tl.program_id(0)
    block = pid % num_blocks
    tile_n = pid // num_blocks
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    rows, pairs, live, a_rows, cols, col_ok, w_base, w_scale_base = _tile_setup(
        sorted_pairs_ptr, w_ptr, w_scale_ptr, block, tile_n, expert, n, top_k, stride_w_expert, stride_scale_expert,
        GATED, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # unused unless GATED (the compiler drops it)
    HALF: tl.constexpr = FP4_GROUP // 2  # packed bytes a scale group
    for k0 in range(0, k, BLOCK_K):
        groups = k0 // FP4_GROUP + tl.arange(0, BLOCK_K // FP4_GROUP)
        group_ok = groups < k // FP4_GROUP
        a_even, a_odd = _inputs(a_ptr, a_rows, live, stride_a, groups, group_ok, HALF)
        acc += _fp4_rows_dot(a_even, a_odd, w_base, w_scale_base, cols, col_ok, groups, group_ok, stride_w_row,
                             stride_scale_row, HALF)
        if GATED:
            acc_up += _fp4_rows_dot(a_even, a_odd, w_base, w_scale_base, n + cols, col_ok, groups, group_ok,
                                    stride_w_row, stride_scale_row, HALF)
    _store_rows(acc, acc_up, out_ptr, stride_out, rows, pairs, live, cols, col_ok, route_weights_ptr, swiglu_limit,
                GATED, CLIP, WEIGHTED)


def fp4_gemv(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, aligned: AlignedPairs,
             top_k: int, tile: GemvTile, *, gated: bool, route_weights: Optional[torch.Tensor] = None,
             swiglu_limit: Optional[float] = None) -> None:
    """Write ``out`` from every used block of ``aligned``, as :func:`grouped_gemm` does for FP4 weights.

    a: [T, K] bf16 gathered by token (``gated``) or [rows, K] in aligned order (the down GEMM, with
    ``route_weights``: [T * top_k] fp32). w: packed FP4 [E, N, K/2] uint8 (``gated``: [E, 2n, K/2],
    gate rows then up rows) with ``w_scale`` [E, N, K/32] uint8 (UE8M0 exponents) or fp32; K a
    multiple of 32. out: [rows, n] in aligned order, or with ``route_weights`` [T * top_k, N] at each
    pair's row (rows of invalid pairs are not written). swiglu_limit: clip gate and up before
    ``silu(gate) * up`` (``gated`` only). The grid depends on the shapes only (CUDA-graph safe).
    """
    num_blocks = aligned.block_experts.numel()
    block_m = aligned.sorted_pairs.numel() // max(num_blocks, 1)
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = 2 * w.shape[2]
    if num_blocks == 0:
        return
    assert w.dtype == torch.uint8, f"fp4_gemv takes packed FP4 uint8 weights, got {w.dtype}"
    assert tile.block_k % FP4_GROUP == 0, f"block_k must be a multiple of {FP4_GROUP}, got {tile.block_k}"
    assert gated or swiglu_limit is None, "swiglu_limit clips the gated GEMM's epilogue only"
    weighted = route_weights is not None
    grid = (num_blocks * triton.cdiv(n, tile.block_n),)
    _fp4_gemv_kernel[grid](
        a, w, w_scale, out, aligned.sorted_pairs, aligned.block_experts, route_weights if weighted else out,
        n, k, num_blocks, top_k, 0.0 if swiglu_limit is None else swiglu_limit,
        a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0),
        GATED=gated, CLIP=swiglu_limit is not None, WEIGHTED=weighted, BLOCK_M=block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, FP4_GROUP=FP4_GROUP, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
