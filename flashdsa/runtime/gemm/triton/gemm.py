"""FP8 block-scaled GEMM in Triton: ``y = (x_fp8 * x_scale) @ (w_fp8 * w_scale)^T``.

Each program owns one ``[BLOCK_M, BLOCK_N]`` output tile and one split of K. It walks K in steps
of 128 (one scale group): each step is an e4m3 tensor-core dot from a zero accumulator, scaled by
``x_scale[m, kb] * w_scale[n // 128, kb]`` and added to an fp32 accumulator. So the tensor core's
reduced-precision FP8 accumulation on SM90 never spans more than 128 products; the sum across
groups is plain fp32, as in DeepGEMM. The tiles come from pipelined pointer loads, which clamp
rows past M or N to the last real row (never out of bounds; those results are not stored) and
mask a last group narrower than 128 with zeros, or, with ``tma`` (Hopper, K a multiple of 16),
from TMA descriptors, whose copy engine fills zeros past the tensor.

``swap_ab`` (decode): the weight tile is the dot's M side and the tokens its N side, so a batch
of 1..64 tokens pads to 16..64 columns while 64 weight rows fill a warpgroup's MMA. With
``split_k > 1`` the programs write fp32 partial sums ``[split, M, N]`` and a second kernel adds
them in a fixed order (deterministic), so a few output tiles can still keep every SM streaming.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashdsa.runtime.gemm.reference import GROUP
from flashdsa.runtime.gemm.triton.configs import GemmConfig, choose_config


@triton.jit
def _tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program, in groups of GROUP_M row tiles so that neighbours share
    weight tiles in L2 (grouped order)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _load_group(x_src, w_src, xs_ptrs, ws_ptrs, kb, m0, n0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                USE_TMA: tl.constexpr):
    """Group kb: the x and w tiles (zeros past K), x_scale[m, kb] and w_scale[., kb]. The tiles
    come through TMA descriptors (boxes at rows m0 / n0; the copy engine fills zeros past the
    tensor) or from pointer tiles at group 0."""
    if USE_TMA:
        x = x_src.load([m0, kb * BLOCK_K])
        w = w_src.load([n0, kb * BLOCK_K])
    elif EVEN_K:
        x = tl.load(x_src + kb * BLOCK_K)
        w = tl.load(w_src + kb * BLOCK_K)
    else:
        in_k = tl.arange(0, BLOCK_K)[None, :] < K - kb * BLOCK_K
        x = tl.load(x_src + kb * BLOCK_K, mask=in_k, other=0.0)
        w = tl.load(w_src + kb * BLOCK_K, mask=in_k, other=0.0)
    return x, w, tl.load(xs_ptrs + kb), tl.load(ws_ptrs + kb)


@triton.jit
def _dot(x, w, SWAP_AB: tl.constexpr):
    """One group's e4m3 dot from a zero accumulator (the tensor core sums at most 128 products):
    [BLOCK_N, BLOCK_M] with SWAP_AB, else [BLOCK_M, BLOCK_N]."""
    if SWAP_AB:  # (one return: the compiler checks every return's type, even under a constexpr if)
        product = tl.dot(w, tl.trans(x))
    else:
        product = tl.dot(x, tl.trans(w))
    return product


@triton.jit
def _add_scaled(acc, product, xs, ws, SWAP_AB: tl.constexpr):
    """``acc + product * xs[m] * ws[n]``; ws has 1 element when the tile lies in one weight block
    (then one FMA per element)."""
    if ws.shape[0] == 1:
        scale = xs * ws
        if SWAP_AB:
            acc += product * scale[None, :]
        else:
            acc += product * scale[:, None]
    elif SWAP_AB:
        acc += product * (ws[:, None] * xs[None, :])
    else:
        acc += product * (xs[:, None] * ws[None, :])
    return acc


@triton.jit
def _gemm_kernel(x_src, xs_ptr, w_src, ws_ptr, out_ptr, M, N, K, num_kb, kb_per_split, stride_split,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 SWAP_AB: tl.constexpr, DEFER: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr):
    """x: [M, K] e4m3, xs: [M, num_kb] fp32, w: [N, K] e4m3, ws: [ceil(N/128), num_kb] fp32 ->
    out (+ split * stride_split): [M, N], the sum over groups [split * kb_per_split, ...).
    x_src / w_src: pointers, or with USE_TMA descriptors of x and w with [BLOCK_M / BLOCK_N, 128] boxes.
    DEFER adds each group's scaled product one step late, while the next group's dot runs."""
    pid_m, pid_n = _tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    # rows of the tile, clamped to the last real row: rows past M or N are read but never stored.
    # 64-bit offsets only for the tile's origin; within a tile 32 bits hold them (fewer registers).
    rm = tl.minimum(tl.arange(0, BLOCK_M), M - 1 - m0)
    rn = tl.minimum(tl.arange(0, BLOCK_N), N - 1 - n0)
    if USE_TMA:
        x_tile, w_tile = x_src, w_src
    else:
        offs_k = tl.arange(0, BLOCK_K)
        x_tile = x_src + m0.to(tl.int64) * K + rm[:, None] * K + offs_k[None, :]
        w_tile = w_src + n0.to(tl.int64) * K + rn[:, None] * K + offs_k[None, :]
    xs_ptrs = xs_ptr + (m0 + rm) * num_kb
    if BLOCK_N <= BLOCK_K:  # the tile lies in one 128-row weight block: one scale per group
        ws_ptrs = ws_ptr + (n0 // BLOCK_K) * num_kb + tl.arange(0, 1)
    else:
        ws_ptrs = ws_ptr + ((n0 + rn) // BLOCK_K) * num_kb
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if DEFER:
        last, last_xs, last_ws = acc, tl.zeros(xs_ptrs.shape, tl.float32), tl.zeros(ws_ptrs.shape, tl.float32)
    kb_start = tl.program_id(1) * kb_per_split
    for kb in range(kb_start, tl.minimum(kb_start + kb_per_split, num_kb)):
        x, w, xs, ws = _load_group(x_tile, w_tile, xs_ptrs, ws_ptrs, kb, m0, n0, K, BLOCK_K, EVEN_K, USE_TMA)
        product = _dot(x, w, SWAP_AB)
        if DEFER:
            acc = _add_scaled(acc, last, last_xs, last_ws, SWAP_AB)
            last, last_xs, last_ws = product, xs, ws
        else:
            acc = _add_scaled(acc, product, xs, ws, SWAP_AB)
    if DEFER:
        acc = _add_scaled(acc, last, last_xs, last_ws, SWAP_AB)
    out = acc.to(out_ptr.dtype.element_ty)
    out_ptr += tl.program_id(1).to(tl.int64) * stride_split + m0.to(tl.int64) * N + n0
    tm = tl.arange(0, BLOCK_M)
    tn = tl.arange(0, BLOCK_N)
    if SWAP_AB:
        ptrs = out_ptr + tm[None, :] * N + tn[:, None]
        mask = (tm[None, :] < M - m0) & (tn[:, None] < N - n0)
    else:
        ptrs = out_ptr + tm[:, None] * N + tn[None, :]
        mask = (tm[:, None] < M - m0) & (tn[None, :] < N - n0)
    tl.store(ptrs, out, mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s, i], in order s = 0, 1, ... (part: [splits, numel] fp32)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    ptrs = part_ptr + offs
    total = tl.load(ptrs, mask=inside, other=0.0)
    for _ in range(1, splits):
        ptrs += numel
        total += tl.load(ptrs, mask=inside, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=inside)


SUM_BLOCK = 1024


def _tma_ready(x_fp8: torch.Tensor, w_fp8: torch.Tensor) -> bool:
    """TMA needs Hopper or later (the interpreter emulates it), 16-byte aligned bases and row
    strides (K a multiple of 16 e4m3 values)."""
    device = x_fp8.device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return x_fp8.shape[1] % 16 == 0 and x_fp8.data_ptr() % 16 == 0 and w_fp8.data_ptr() % 16 == 0


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, config: Optional[GemmConfig] = None) -> torch.Tensor:
    """x_fp8: [M, K] e4m3, x_scale: [M, ceil(K/128)] fp32, w_fp8: [N, K] e4m3, w_scale:
    [ceil(N/128), ceil(K/128)] fp32 -> [M, N] ``out_dtype``. ``config`` overrides the heuristic's
    launch shape (benchmarks sweep it)."""
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or choose_config(m, n, k, x_fp8.device)
    num_kb = triton.cdiv(k, GROUP)
    kb_per_split = triton.cdiv(num_kb, cfg.split_k)
    splits = triton.cdiv(num_kb, kb_per_split)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=out.device)
    use_tma = cfg.tma and _tma_ready(x_fp8, w_fp8)
    x_src = TensorDescriptor.from_tensor(x_fp8, [cfg.block_m, GROUP]) if use_tma else x_fp8
    w_src = TensorDescriptor.from_tensor(w_fp8, [cfg.block_n, GROUP]) if use_tma else w_fp8
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)
    _gemm_kernel[grid](
        x_src, x_scale, w_src, w_scale, target, m, n, k, num_kb, kb_per_split, m * n,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP, GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab,
        DEFER=cfg.defer, EVEN_K=k % GROUP == 0, USE_TMA=use_tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](target, out, m * n, splits, BLOCK=SUM_BLOCK,
                                                             num_warps=4)
    return out
