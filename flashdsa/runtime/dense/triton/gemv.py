"""dense_linear at decode sizes: one Triton GEMV launch, each weight row read once.

Program (n, m) computes rows ``[n * BLOCK_N, (n + 1) * BLOCK_N)`` of token m's output: it walks K
in BLOCK_K steps, multiplying the weight tile by x's slice elementwise into an fp32 tile, and sums
the tile's columns once at the end (a fixed order: the result does not depend on timing). BLOCK_N
is chosen so that about two programs an SM read ``BLOCK_N`` rows each (V4-Flash's router: 256 rows
of 4096, one row a program, all of K in one step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 264  # two an SM on an H100 (132 SMs)
TILE = 4096  # weight elements a program holds a step: 32 fp32 accumulators a thread at 4 warps
MIN_BLOCK_K = 128


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_xm, stride_xk, stride_wn, stride_om,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :],
                    mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0)
        x = tl.load(x_ptr + m * stride_xm + cols * stride_xk, mask=cols < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + m * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def launch_shape(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for an [n, k] weight: BLOCK_N rows a program so that about TARGET_PROGRAMS
    programs run (powers of two, 1..16), BLOCK_K the rest of the TILE (at most k, rounded up)."""
    rows_per_program = max(1, n // TARGET_PROGRAMS)
    block_n = min(16, 1 << (rows_per_program.bit_length() - 1))  # the largest power of two not above it
    block_k = max(MIN_BLOCK_K, min(TILE // block_n, triton.next_power_of_2(max(k, 1))))
    return block_n, block_k


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS), weight: [N, K] unit column stride -> [M, N] in x's dtype."""
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    block_n, block_k = launch_shape(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n), m)](x, weight, out, n, k, x.stride(0), x.stride(1), weight.stride(0),
                                               out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
