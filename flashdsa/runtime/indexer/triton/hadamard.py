"""Walsh-Hadamard rotation in Triton: the reference's butterfly, stage for stage.

The same log2(n) stages of ``(a + b, a - b)`` in the same order and precision as
``indexer.reference.hadamard_transform``, so results are bit-identical to it (a matmul with the
Hadamard matrix would sum in another order and round differently, which flips FP8 codes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16


@triton.jit
def rotate_rows(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """Butterflies of ``x: [ROWS, N]`` (Sylvester order), unscaled: stage h pairs element i with
    i + h inside each group of 2h, like ``reshape(.., N // (2h), 2, h)`` in the reference."""
    for stage in tl.static_range(LOG_N):
        pairs = tl.permute(tl.reshape(x, (ROWS, N >> (stage + 1), 2, 1 << stage)), (0, 1, 3, 2))
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, N))
    return x


@triton.jit
def _hadamard_kernel(x_ptr, out_ptr, num_rows, scale, N: tl.constexpr, LOG_N: tl.constexpr,
                     ROWS: tl.constexpr, COMPUTE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, N)
    ok = (rows < num_rows)[:, None]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(COMPUTE)
    y = rotate_rows(x, ROWS, N, LOG_N) * scale
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x: [..., n] bf16/fp16/fp32/fp64, n a power of two -> ``x @ H * n^-0.5``, same shape and
    dtype; fp32 arithmetic (fp64 for fp64 input), rounded once to x's dtype."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        compute = tl.float64 if x.dtype == torch.float64 else tl.float32
        grid = (triton.cdiv(rows.shape[0], ROWS_PER_PROGRAM),)
        _hadamard_kernel[grid](rows, out, rows.shape[0], n**-0.5, N=n, LOG_N=n.bit_length() - 1,
                               ROWS=ROWS_PER_PROGRAM, COMPUTE=compute)
    return out.view(x.shape)
