"""positions_to_slots in Triton: one program per (token, chunk of its positions), one kernel a layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # positions a program maps


@triton.jit
def _slots_kernel(pos_ptr, seq_ptr, table_ptr, out_ptr, width, stride_p, stride_t, max_blocks,
                  PAGE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    pos = tl.load(pos_ptr + t * stride_p + cols, mask=inside, other=-1).to(tl.int64)
    page = pos // PAGE
    listed = inside & (pos >= 0) & (page < max_blocks)
    block = tl.load(table_ptr + tl.load(seq_ptr + t) * stride_t + page, mask=listed, other=-1).to(tl.int64)
    slot = tl.where(listed & (block >= 0), block * PAGE + pos % PAGE, -1)
    tl.store(out_ptr + t * width + cols, slot.to(tl.int32), mask=inside)


def positions_to_slots(positions: torch.Tensor, seq_ids: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    tokens, width = positions.shape
    out = torch.empty(tokens, width, dtype=torch.int32, device=positions.device)
    if out.numel() == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(width))
    _slots_kernel[(tokens, triton.cdiv(width, block))](positions, seq_ids, block_tables, out, width,
                                                        positions.stride(0), block_tables.stride(0),
                                                        block_tables.shape[1], PAGE=block_size, BLOCK=block,
                                                        num_warps=4)
    return out
