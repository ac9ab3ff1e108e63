"""The indexer queries' Hadamard rotation and e4m3 quantization in one Triton kernel (in torch: the
rotation kernel and a dozen elementwise and reduction ops, each a CUDA-graph node of every decode
step), bit-identical to the reference: the same butterfly, the rounding to the input's dtype, and
the power-of-two scale and e4m3 rounding of the indexer cache write."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.cache.triton.writes import rotate_quantize_rows
from flashdsa.runtime.fp8 import AMAX_FLOOR, E4M3, E4M3_MAX

ROWS_PER_PROGRAM = 16


@triton.jit
def _rotate_quantize_kernel(x_ptr, codes_ptr, scale_ptr, num_rows, rotate_scale, amax_floor, e4m3_max,
                            D: tl.constexpr, LOG_D: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < num_rows
    offs = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0)
    codes, scale = rotate_quantize_rows(x, ROWS, D, LOG_D, rotate_scale, amax_floor, e4m3_max)
    tl.store(codes_ptr + offs, codes, mask=ok[:, None])
    tl.store(scale_ptr + rows, scale, mask=ok)


def rotate_quantize_indexer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., n] bf16/fp16/fp32 (n a power of two) -> (e4m3 [..., n], scale fp32 [...])."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).contiguous()
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        grid = (triton.cdiv(rows.shape[0], ROWS_PER_PROGRAM),)
        _rotate_quantize_kernel[grid](rows, codes, scales, rows.shape[0], n**-0.5, AMAX_FLOOR, E4M3_MAX,
                                      D=n, LOG_D=n.bit_length() - 1, ROWS=ROWS_PER_PROGRAM)
    return codes.view(E4M3).view(x.shape), scales.view(x.shape[:-1])
