"""Row-wise argmax over vocabulary-wide rows: what greedy decoding does every step.

``torch.argmax`` reduces each row in one thread block, so a batch of one 129K-token row keeps one
SM busy for ~27 us on an H100. Here the row is cut into chunks: one Triton program a chunk finds
its best (value, first index), a second launch picks the best chunk of each row. Same answer as
``torch.argmax(dim=1)``: the first index of the largest value, a NaN counting as larger than
everything (the first NaN wins). Off CUDA it is torch's (unless the Triton interpreter runs the
kernels, as the CPU tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.checks import check_tensor
from flashdsa.runtime.dispatch import interpreting

CHUNK = 4096  # logits per first-stage program
MAX_CHUNKS = 1024  # second-stage width: rows up to 4M logits
BIG = tl.constexpr(2**31 - 1)  # past any index (int32)


@triton.jit
def _chunk_kernel(x_ptr, best_ptr, where_ptr, width, stride_x, chunks, CHUNK: tl.constexpr):
    """Chunk c of row r -> best[r, c] (its largest value, NaN if it holds one) and where[r, c] (the
    first index of that value, or of its first NaN)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan, cols, BIG), 0)
    best = tl.max(tl.where(is_nan, float("-inf"), x), 0)
    where = tl.min(tl.where((x == best) & (cols < width), cols, BIG), 0)
    out = row * chunks + tl.program_id(1)
    tl.store(best_ptr + out, tl.where(first_nan < BIG, float("nan"), best))
    tl.store(where_ptr + out, tl.where(first_nan < BIG, first_nan, where))


@triton.jit
def _rows_kernel(best_ptr, where_ptr, out_ptr, chunks, CHUNKS: tl.constexpr):
    """Row r's answer from its chunks' (best, where): the first NaN's index if any chunk holds one,
    else the lowest index among the chunks level with the largest value."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    ok = c < chunks
    best = tl.load(best_ptr + row * chunks + c, mask=ok, other=float("-inf"))
    where = tl.load(where_ptr + row * chunks + c, mask=ok, other=BIG)
    first_nan = tl.min(tl.where(ok & (best != best), where, BIG), 0)
    top = tl.max(tl.where(best != best, float("-inf"), best), 0)
    level = tl.min(tl.where(ok & (best == top), where, BIG), 0)
    tl.store(out_ptr + row, tl.where(first_nan < BIG, first_nan, level).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x: [N, V]`` bf16/fp16/fp32 (unit column stride on CUDA) -> ``[N]`` int64, as
    ``x.argmax(dim=1)``. No host sync."""
    check_tensor("x", x, (torch.bfloat16, torch.float16, torch.float32), [None, None], "float [N, V]",
                 contiguous=False)
    rows, width = x.shape
    chunks = triton.cdiv(width, CHUNK)
    on_triton = x.device.type == "cuda" or interpreting()
    if not on_triton or width == 0 or chunks > MAX_CHUNKS or x.stride(1) != 1:
        return x.argmax(dim=1)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    best = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    where = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    _chunk_kernel[(rows, chunks)](x, best, where, width, x.stride(0), chunks, CHUNK=CHUNK, num_warps=8)
    _rows_kernel[(rows,)](best, where, out, chunks, CHUNKS=triton.next_power_of_2(chunks), num_warps=4)
    return out
