"""mHC in Triton: the mixing GEMM split over K, then one program per token (and D block) for the
rest of the pre part, and one elementwise kernel for the post part.

``_mix_kernel``: ``part[s, t] = h[t, K_s] @ fn[:, K_s]^T`` and ``sq[s, t] = sum h[t, K_s]^2`` over
split s of the flattened streams (K = n D), fp32 FMA dot (``ieee``: no TF32; for a few tokens
products summed over the block). ``_pre_kernel`` (one warp):
sums the splits, scales the raw mixes by ``rsqrt(mean(h^2) + eps)`` (the RMS normalization moved
past the linear map), then sigmoid / softmax / Sinkhorn on the n x n matrix in registers and the
collapse ``sum_i pre_i h_i`` of its D block; every D block recomputes the (tiny) mixes, the first
writes post and comb. ``_post_kernel``: ``post_k y + sum_j comb[j, k] h_j`` with torch's roundings
(y optionally the rounded sum of two block outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 264  # two waves of an H100's 132 SMs for the mixing GEMM
MAX_SPLITS = 128
COLLAPSE_BLOCK = 1024  # D elements per collapse program
POST_ELEMENTS = 1024  # streams x D elements per post program
SMALL_TOKENS = 4  # up to this many tokens the mixing GEMM sums products (a dot pads to 16 rows)
# One warp a pre program: the Sinkhorn loop's row and column sums stay within the warp (shuffles,
# no shared-memory round trips). H100, V4-Flash widths: hc_pre 13.0 -> 8.0 us at T=1 with
# SMALL_TOKENS, 20.8 -> 19.2 us at T=32.
PRE_WARPS = 1


@triton.jit
def _mix_kernel(h_ptr, fn_ptr, part_ptr, sq_ptr, tokens, k_total, blocks_per_split,
                WIDTH: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
    split = tl.program_id(1)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, WP)
    row_ok = rows < tokens
    acc = tl.zeros([BT, WP], dtype=tl.float32)
    sq = tl.zeros([BT], dtype=tl.float32)
    first = split * blocks_per_split * BK
    for block in range(0, blocks_per_split):
        ks = first + block * BK + tl.arange(0, BK)
        k_ok = ks < k_total
        x = tl.load(h_ptr + rows[:, None].to(tl.int64) * k_total + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + cols[None, :] * k_total + ks[:, None], mask=(cols[None, :] < WIDTH) & k_ok[:, None],
                    other=0.0)
        if DOT:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:  # a few tokens: products summed over the block, no 16-row MMA tile
            acc += tl.sum(x[:, :, None] * w[None, :, :], 1)
        sq += tl.sum(x * x, 1)
    at = split * tokens + rows
    tl.store(part_ptr + at[:, None].to(tl.int64) * WIDTH + cols[None, :], acc,
             mask=row_ok[:, None] & (cols[None, :] < WIDTH))
    tl.store(sq_ptr + at, sq, mask=row_ok)


@triton.jit
def _pre_kernel(part_ptr, sq_ptr, h_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr, tokens, splits, dim, iters,
                norm_eps, hc_eps, N: tl.constexpr, NP: tl.constexpr, WIDTH: tl.constexpr, SP: tl.constexpr,
                BD: tl.constexpr, COMB: tl.constexpr):
    t = tl.program_id(0)
    s = tl.arange(0, SP)
    s_ok = s < splits
    i = tl.arange(0, NP)
    i_ok = i < N
    sq = tl.sum(tl.load(sq_ptr + s * tokens + t, mask=s_ok, other=0.0), 0)
    rstd = 1.0 / tl.sqrt(sq / (N * dim) + norm_eps)
    rows = part_ptr + (s * tokens + t).to(tl.int64) * WIDTH  # [SP] the token's partial mixes per split
    raw = tl.sum(tl.load(rows[:, None] + i[None, :], mask=s_ok[:, None] & i_ok[None, :], other=0.0), 0)
    pre = tl.sigmoid(raw * rstd * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=i_ok, other=0.0)) + hc_eps
    if COMB:
        if tl.program_id(1) == 0:
            post_raw = tl.sum(tl.load(rows[:, None] + N + i[None, :], mask=s_ok[:, None] & i_ok[None, :], other=0.0), 0)
            post = 2 * tl.sigmoid(post_raw * rstd * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i, mask=i_ok, other=0.0))
            tl.store(post_ptr + t * N + i, post, mask=i_ok)
            ij = i[:, None] * N + i[None, :]  # [j, k]: comb[j, k], softmax over k
            ij_ok = i_ok[:, None] & i_ok[None, :]
            comb_raw = tl.sum(tl.load(rows[:, None, None] + 2 * N + ij[None, :, :],
                                      mask=s_ok[:, None, None] & ij_ok[None, :, :], other=0.0), 0)
            logits = comb_raw * rstd * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + ij, mask=ij_ok, other=0.0)
            logits = tl.where(ij_ok, logits, float("-inf"))
            top = tl.where(i_ok, tl.max(logits, 1), 0.0)
            e = tl.where(ij_ok, tl.exp(logits - top[:, None]), 0.0)
            comb = tl.where(ij_ok, e / tl.where(i_ok, tl.sum(e, 1), 1.0)[:, None] + hc_eps, 0.0)
            comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
            for _ in range(1, iters):
                comb = comb / (tl.sum(comb, 1)[:, None] + hc_eps)
                comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
            tl.store(comb_ptr + t * N * N + ij, comb, mask=ij_ok)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_ok = d < dim
    streams = tl.load(h_ptr + (t * N + i[:, None]).to(tl.int64) * dim + d[None, :], mask=i_ok[:, None] & d_ok[None, :],
                      other=0.0)
    x = tl.sum(pre[:, None] * streams.to(tl.float32), 0)
    tl.store(x_ptr + t.to(tl.int64) * dim + d, x.to(streams.dtype), mask=d_ok)


@triton.jit
def _post_kernel(y_ptr, extra_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, dim, stride_y, stride_e, N: tl.constexpr,
                 NP: tl.constexpr, BD: tl.constexpr, EXTRA: tl.constexpr):
    t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_ok = d < dim
    i = tl.arange(0, NP)
    i_ok = i < N
    dtype = h_ptr.dtype.element_ty
    y = tl.load(y_ptr + t.to(tl.int64) * stride_y + d, mask=d_ok, other=0.0).to(tl.float32)
    if EXTRA:  # y + extra rounded to the streams' dtype, as torch's sum of the two
        y = (y + tl.load(extra_ptr + t.to(tl.int64) * stride_e + d, mask=d_ok, other=0.0).to(tl.float32))
        y = y.to(dtype).to(tl.float32)
    post = tl.load(post_ptr + t * N + i, mask=i_ok, other=0.0).to(dtype).to(tl.float32)
    ij_ok = i_ok[:, None] & i_ok[None, :]
    comb = tl.load(comb_ptr + t * N * N + i[:, None] * N + i[None, :], mask=ij_ok, other=0.0).to(dtype).to(tl.float32)
    at = (t * N + i[:, None]).to(tl.int64) * dim + d[None, :]  # [NP, BD]
    at_ok = i_ok[:, None] & d_ok[None, :]
    streams = tl.load(h_ptr + at, mask=at_ok, other=0.0).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * streams[:, None, :], 0)  # [k, BD] = sum_j comb[j, k] h_j
    out = (post[:, None] * y[None, :]).to(dtype).to(tl.float32) + mixed.to(dtype).to(tl.float32)
    tl.store(out_ptr + at, out.to(dtype), mask=at_ok)


def _padded(count: int) -> int:
    """A register-tile length for ``count`` items: a power of two, at least 2."""
    return max(2, triton.next_power_of_2(count))


def _mixes(h: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-split partial raw mixes ``[splits, T, W]`` and sums of squares ``[splits, T]`` fp32."""
    tokens, width, k_total = h.shape[0], fn.shape[0], fn.shape[1]
    if tokens <= SMALL_TOKENS:  # products summed over the block (DOT off below)
        bt, bk = max(2, triton.next_power_of_2(tokens)), 128
    elif tokens <= 16:
        bt, bk = 16, 128
    else:
        bt, bk = 64, 64
    token_blocks, k_blocks = triton.cdiv(tokens, bt), triton.cdiv(k_total, bk)
    splits = max(1, min(k_blocks, MAX_SPLITS, TARGET_PROGRAMS // token_blocks))
    per_split = triton.cdiv(k_blocks, splits)
    splits = triton.cdiv(k_blocks, per_split)  # no empty split
    part = torch.empty(splits, tokens, width, dtype=torch.float32, device=h.device)
    sq = torch.empty(splits, tokens, dtype=torch.float32, device=h.device)
    _mix_kernel[(token_blocks, splits)](h, fn, part, sq, tokens, k_total, per_split, WIDTH=width,
                                        WP=max(16, triton.next_power_of_2(width)), BT=bt, BK=bk, DOT=tokens > SMALL_TOKENS,
                                        num_warps=4)
    return part, sq, splits


def _pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
         norm_eps: float, comb: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, n, dim = h.shape
    x = torch.empty(tokens, dim, dtype=h.dtype, device=h.device)
    post = torch.empty(tokens, n, dtype=torch.float32, device=h.device)
    mixing = torch.empty(tokens, n, n, dtype=torch.float32, device=h.device)
    if tokens == 0:
        return x, post, mixing
    part, sq, splits = _mixes(h, fn)
    block = min(COLLAPSE_BLOCK, triton.next_power_of_2(dim))
    _pre_kernel[(tokens, triton.cdiv(dim, block))](
        part, sq, h, base, scale, x, post, mixing, tokens, splits, dim, iters, norm_eps, hc_eps, N=n,
        NP=_padded(n), WIDTH=fn.shape[0], SP=_padded(splits), BD=block, COMB=comb, num_warps=PRE_WARPS)
    return x, post, mixing


def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
           norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _pre(h, fn, base, scale, iters, hc_eps, norm_eps, comb=True)


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    return _pre(h, fn, base, scale, 1, hc_eps, norm_eps, comb=False)[0]


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            extra: torch.Tensor | None = None) -> torch.Tensor:
    tokens, n, dim = h.shape
    out = torch.empty_like(h)
    if tokens == 0:
        return out
    padded = _padded(n)
    block = min(triton.next_power_of_2(dim), max(16, POST_ELEMENTS // padded))
    second = y if extra is None else extra  # never read without EXTRA
    _post_kernel[(tokens, triton.cdiv(dim, block))](y, second, h, post, comb, out, dim, y.stride(0), second.stride(0),
                                                    N=n, NP=padded, BD=block, EXTRA=extra is not None, num_warps=4)
    return out
