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

:func:`fp8_linear` (decode, M <= DECODE_MAX_M) is the same kernel in one launch: it reads the
float activations and quantizes each ``[BLOCK_M, 128]`` group it walks in registers with the
quantizer's own arithmetic (``quantize.quantize_groups``: same codes and scales, so the result is
quantize-then-``fp8_gemm``'s, bit for bit; every program of a row tile repeats that work), and the
split that finishes a tile last adds the partial sums itself. Each split stores its partial tile,
passes a CTA barrier (every thread's stores precede the ticket), then takes a ticket from the
tile's counter with an acq_rel atomic (release: the stores are visible before the count; acquire:
the last one's loads see every split's stores). The program that draws ticket ``splits - 1`` adds
the partials in split order 0, 1, ... (as ``_sum_splits_kernel`` does), stores the output and
sets the counter back to 0, so the per-device counter buffer, zeroed once, serves every later
launch and CUDA-graph replay. Two such launches must not run concurrently on one device (streams
of one device share the counters).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashdsa.runtime.fp8 import AMAX_FLOOR, E4M3_MAX
from flashdsa.runtime.gemm.reference import GROUP
from flashdsa.runtime.gemm.triton.configs import DECODE_MAX_M, GemmConfig, choose_config
from flashdsa.runtime.gemm.triton.quantize import quantize_groups
from flashdsa.runtime.streams import on_side_stream

logger = logging.getLogger(__name__)


@triton.jit
def _tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile ``pid`` of an [M, N] output, in groups of GROUP_M row tiles so that
    neighbours share weight tiles in L2 (grouped order)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _load_group(x_src, w_src, xs_ptrs, ws_ptrs, kb, m0, x_k0, w_n0, K, amax_floor, e4m3_max,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, QUANTIZE: tl.constexpr,
                POW2: tl.constexpr):
    """Group kb: the x and w tiles (zeros past K), x_scale[m, kb] and w_scale[., kb]. The tiles
    come through TMA descriptors (boxes at row m0 and column x_k0 of x, row w_n0 of w; the copy
    engine fills zeros past the tensor) or from pointer tiles at group 0. With QUANTIZE x is
    float: its tile is quantized here (e4m3 codes, and the scales in place of x_scale's)."""
    if USE_TMA:
        x = x_src.load([m0, x_k0 + kb * BLOCK_K])
        w = w_src.load([w_n0, kb * BLOCK_K])
    elif EVEN_K:
        x = tl.load(x_src + kb * BLOCK_K)
        w = tl.load(w_src + kb * BLOCK_K)
    else:
        in_k = tl.arange(0, BLOCK_K)[None, :] < K - kb * BLOCK_K
        x = tl.load(x_src + kb * BLOCK_K, mask=in_k, other=0.0)
        w = tl.load(w_src + kb * BLOCK_K, mask=in_k, other=0.0)
    if QUANTIZE:
        codes, xs = quantize_groups(x, amax_floor, e4m3_max, POW2)
        x = codes.to(tl.float8e4nv, bitcast=True)
    else:
        xs = tl.load(xs_ptrs + kb)
    return x, w, xs, tl.load(ws_ptrs + kb)


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
def _gemm_kernel(x_src, xs_ptr, w_src, ws_ptr, out_ptr, part_ptr, tickets_ptr, M, N, K, stride_x, num_kb,
                 kb_per_split, stride_split, stride_out, amax_floor, e4m3_max, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, DEFER: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, QUANTIZE: tl.constexpr, POW2: tl.constexpr,
                 SPLIT: tl.constexpr, TICKETS: tl.constexpr):
    """x: [M, K] e4m3 (rows stride_x apart), xs: [M, num_kb] fp32, w: [N, K] e4m3, ws: [ceil(N/128),
    num_kb] fp32 -> the sum over groups [split * kb_per_split, ...): into out: [M, N], or with SPLIT
    into part[split]: [M, N] fp32 (stride_split elements apart), where with TICKETS the last split
    of the tile to finish adds part[0], part[1], ... into out (tickets: one int32 counter a tile, 0
    before and after). Rows of out and of each part are stride_out apart.
    A grouped projection (G = stride_out // N > 1, N a multiple of 128) runs G such products in
    one launch, the programs of group g after those of g - 1: x's columns [g K, (g + 1) K) (x and
    xs rows hold all groups) through w's rows [g N, (g + 1) N) into out's columns [g N, (g + 1) N).
    x_src / w_src: pointers, or with USE_TMA descriptors of x and w with [BLOCK_M / BLOCK_N, 128] boxes.
    QUANTIZE: x is bf16/fp16/fp32, quantized group by group here like quantize_activations
    (POW2: power-of-two scales); xs is unused. DEFER adds each group's scaled product one step
    late, while the next group's dot runs."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    group = tl.program_id(0) // tiles
    pid_m, pid_n = _tile_coords(tl.program_id(0) % tiles, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    x_k0 = group * K  # the group's first column of x, row of w (below) and column of out
    w_n0 = group * N + n0
    groups_kb = (stride_out // N) * num_kb  # row stride of xs
    # rows of the tile, clamped to the last real row: rows past M or N are read but never stored.
    # 64-bit offsets only for the tile's origin; within a tile 32 bits hold them (fewer registers).
    rm = tl.minimum(tl.arange(0, BLOCK_M), M - 1 - m0)
    rn = tl.minimum(tl.arange(0, BLOCK_N), N - 1 - n0)
    if USE_TMA:
        x_tile, w_tile = x_src, w_src
    else:
        offs_k = tl.arange(0, BLOCK_K)
        x_tile = x_src + m0.to(tl.int64) * stride_x + x_k0 + rm[:, None] * stride_x + offs_k[None, :]
        w_tile = w_src + w_n0.to(tl.int64) * K + rn[:, None] * K + offs_k[None, :]
    xs_ptrs = xs_ptr + (m0 + rm) * groups_kb + group * num_kb
    if BLOCK_N <= BLOCK_K:  # the tile lies in one 128-row weight block: one scale per group
        ws_ptrs = ws_ptr + (w_n0 // BLOCK_K) * num_kb + tl.arange(0, 1)
    else:
        ws_ptrs = ws_ptr + ((w_n0 + rn) // BLOCK_K) * num_kb
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if DEFER:
        last, last_xs, last_ws = acc, tl.zeros(xs_ptrs.shape, tl.float32), tl.zeros(ws_ptrs.shape, tl.float32)
    kb_start = tl.program_id(1) * kb_per_split
    for kb in range(kb_start, tl.minimum(kb_start + kb_per_split, num_kb)):
        x, w, xs, ws = _load_group(x_tile, w_tile, xs_ptrs, ws_ptrs, kb, m0, x_k0, w_n0, K, amax_floor, e4m3_max,
                                   BLOCK_K, EVEN_K, USE_TMA, QUANTIZE, POW2)
        product = _dot(x, w, SWAP_AB)
        if DEFER:
            acc = _add_scaled(acc, last, last_xs, last_ws, SWAP_AB)
            last, last_xs, last_ws = product, xs, ws
        else:
            acc = _add_scaled(acc, product, xs, ws, SWAP_AB)
    if DEFER:
        acc = _add_scaled(acc, last, last_xs, last_ws, SWAP_AB)
    tile = m0.to(tl.int64) * stride_out + group * N + n0  # the tile's origin in out and in each part[split]
    tm = tl.arange(0, BLOCK_M)
    tn = tl.arange(0, BLOCK_N)
    if SWAP_AB:
        offs = tm[None, :] * stride_out + tn[:, None]
        mask = (tm[None, :] < M - m0) & (tn[:, None] < N - n0)
    else:
        offs = tm[:, None] * stride_out + tn[None, :]
        mask = (tm[:, None] < M - m0) & (tn[None, :] < N - n0)
    if SPLIT:
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * stride_split + tile + offs, acc, mask=mask)
        if TICKETS:
            _sum_if_last(part_ptr + tile + offs, out_ptr + tile + offs, mask, stride_split,
                         tickets_ptr + tl.program_id(0))
    else:
        tl.store(out_ptr + tile + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_if_last(part_ptrs, out_ptrs, mask, stride_split, ticket_ptr):
    """After this program stored its partial tile (at ``part_ptrs + split * stride_split``): take a
    ticket; the program with the last one adds every split's tile in split order into out_ptrs
    and resets the counter to 0. The barrier orders every thread's stores before the ticket, the
    acq_rel atomic publishes them (release) and makes the others' visible to the last program
    (acquire; its loads bypass L1, "cg", besides)."""
    splits = tl.num_programs(1)
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == splits - 1:
        total = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        for _ in range(1, splits):
            part_ptrs += stride_split
            total += tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
        tl.store(ticket_ptr, 0)


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
MAX_TICKET_TILES = 1 << 14  # counters a device keeps for fp8_linear's split-K tiles (64 KiB)


def _tma_ready(x_fp8: torch.Tensor, w_fp8: torch.Tensor) -> bool:
    """TMA needs Hopper or later (the interpreter emulates it), 16-byte aligned bases and row
    strides (K a multiple of 16 e4m3 values)."""
    device = x_fp8.device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return x_fp8.shape[1] % 16 == 0 and x_fp8.data_ptr() % 16 == 0 and w_fp8.data_ptr() % 16 == 0


_counters: dict[torch.device, torch.Tensor] = {}  # device -> fp8_linear's split-K ticket counters


def _counters_for(device: torch.device, tiles: int) -> Optional[torch.Tensor]:
    """The device's int32 ticket counters (MAX_TICKET_TILES of them, zeroed once when first
    needed; every launch leaves them at 0), or None where they cannot serve: more tiles than
    counters, on a side stream (``runtime.streams``), or none made yet while a CUDA graph is being
    captured (a buffer made during capture would be zeroed only at replay). Then the launch sums
    its splits in a second kernel."""
    if tiles > MAX_TICKET_TILES or on_side_stream(device):  # a side branch may run beside the counters' owner
        return None
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            logger.warning("fp8_linear: no split-K counters on %s before a CUDA graph capture; this capture "
                           "sums the splits in a second kernel", device)
            return None
        _counters[device] = torch.zeros(MAX_TICKET_TILES, dtype=torch.int32, device=device)
    return _counters[device]


def _launch(x: torch.Tensor, x_scale: Optional[torch.Tensor], w_fp8: torch.Tensor, w_scale: torch.Tensor,
            out_dtype: torch.dtype, cfg: GemmConfig, pow2_scales: bool = False, groups: int = 1) -> torch.Tensor:
    """``x @ dequant(w)^T`` into a new [M, N] ``out_dtype`` tensor: x e4m3 with ``x_scale``, or
    float (``x_scale`` None: quantized in the kernel, then split K sums through tickets). With
    ``groups`` > 1, x: [M, groups * K] and w: [groups * N, K] are a grouped projection (the kernel's
    docstring) -> [M, groups * N]."""
    m, k = x.shape[0], x.shape[1] // groups
    n = w_fp8.shape[0] // groups
    if groups > 1 and (n % cfg.block_n or k % GROUP):
        raise ValueError(f"a grouped launch needs K ({k}) a multiple of {GROUP} and N ({n}) of the tile's {cfg.block_n}")
    out = torch.empty(m, groups * n, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    quantize = x_scale is None
    num_kb = triton.cdiv(k, GROUP)
    kb_per_split = triton.cdiv(num_kb, cfg.split_k)
    splits = triton.cdiv(num_kb, kb_per_split)
    tiles = groups * triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    parts = None if splits == 1 else torch.empty(splits, *out.shape, dtype=torch.float32, device=out.device)
    tickets = _counters_for(out.device, tiles) if quantize and parts is not None else None
    use_tma = cfg.tma and not quantize and _tma_ready(x, w_fp8)
    x_src = TensorDescriptor.from_tensor(x, [cfg.block_m, GROUP]) if use_tma else x
    w_src = TensorDescriptor.from_tensor(w_fp8, [cfg.block_n, GROUP]) if use_tma else w_fp8
    _gemm_kernel[(tiles, splits)](  # pointers a variant does not read get out's or x's
        x_src, x if quantize else x_scale, w_src, w_scale, out, out if parts is None else parts,
        out if tickets is None else tickets, m, n, k, x.stride(0), num_kb, kb_per_split, out.numel(), out.shape[1],
        AMAX_FLOOR, E4M3_MAX,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP, GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab,
        DEFER=cfg.defer, EVEN_K=k % GROUP == 0, USE_TMA=use_tma, QUANTIZE=quantize, POW2=pow2_scales,
        SPLIT=parts is not None, TICKETS=tickets is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if parts is not None and tickets is None:
        _sum_splits_kernel[(triton.cdiv(out.numel(), SUM_BLOCK),)](parts, out, out.numel(), splits, BLOCK=SUM_BLOCK,
                                                                   num_warps=4)
    return out


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, config: Optional[GemmConfig] = None, groups: int = 1) -> torch.Tensor:
    """x_fp8: [M, K] e4m3, x_scale: [M, ceil(K/128)] fp32, w_fp8: [N, K] e4m3, w_scale:
    [ceil(N/128), ceil(K/128)] fp32 -> [M, N] ``out_dtype``. ``config`` overrides the heuristic's
    launch shape (benchmarks sweep it). ``groups`` > 1: a grouped projection (K and N per group
    multiples of 128; x: [M, groups * K], w: [groups * N, K] -> [M, groups * N]), one launch."""
    cfg = config or choose_config(x_fp8.shape[0], w_fp8.shape[0], x_fp8.shape[1] // groups, x_fp8.device)
    return _launch(x_fp8, x_scale, w_fp8, w_scale, out_dtype, cfg, groups=groups)


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, pow2_scales: bool,
               out_dtype: torch.dtype, config: Optional[GemmConfig] = None, groups: int = 1) -> torch.Tensor:
    """x: [M, K] bf16/fp16/fp32 (rows may be strided), 0 < M <= DECODE_MAX_M, quantized per token
    and 128 channels in the kernel (``pow2_scales`` as in quantize_activations); w_fp8, w_scale and
    ``groups`` as in :func:`fp8_gemm` -> [M, N] ``out_dtype``, one launch: quantize_activations then
    fp8_gemm, bit for bit. ``config`` overrides the heuristic's (swap-AB) launch shape."""
    m = x.shape[0]
    if not 0 < m <= DECODE_MAX_M:
        raise ValueError(f"x must have 1..{DECODE_MAX_M} rows (the decode regime), got {list(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or choose_config(m, w_fp8.shape[0], x.shape[1] // groups, x.device)
    return _launch(x, None, w_fp8, w_scale, out_dtype, cfg, pow2_scales, groups)
