"""Alignment of (token, slot) pairs by expert in Triton: deterministic, no sync, static sizes.

The pairs are cut into chunks (one when they fit in ``MIN_CHUNK``: one launch). A
count launch writes each chunk's per-expert counts; the place launch, one program per chunk, sums
them into each expert's total and the count of the chunks before its own, so it knows where
expert e's run starts (blocks before e, times block_m) and how many of e's pairs precede the
chunk. Inside the chunk a one-hot ``[SUB, E]`` matrix and its running sum along the pairs give
each pair's rank among its expert's pairs: its row. The same programs then write each block's
expert and -1 into the padding rows, so every element of both outputs is written exactly once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.moe.alignment import AlignedPairs

# Pairs per chunk at least (T * top_k <= MIN_CHUNK: a single program, one launch). Small chunks keep
# decode's alignment short: a lone program walks every pair and block serially (V4-Flash experts on
# an H100, _place_kernel: 25 us at 192 pairs and 62 us at 768 with 1024 here; 8 and 7 us with 64).
MIN_CHUNK = 64
MAX_CHUNKS = 64  # chunks at most (each place program reads every chunk's counts)
SUB = 32  # pairs per one-hot step
STEP_BLOCKS = 16  # blocks per step of the block-expert and padding pass


def experts_padded(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


@triton.jit
def _one_hot(ids_ptr, start, end, num_experts, SUB: tl.constexpr, E_PAD: tl.constexpr):
    """Pairs [start, min(start + SUB, end)): ids, validity and one-hot expert matrix [SUB, E_PAD] int32."""
    pairs = start + tl.arange(0, SUB)
    expert = tl.load(ids_ptr + pairs, mask=pairs < end, other=-1)
    valid = (expert >= 0) & (expert < num_experts)
    hot = (expert[:, None] == tl.arange(0, E_PAD)[None, :]) & valid[:, None]
    return pairs, valid, hot.to(tl.int32)


@triton.jit
def _chunk_counts(ids_ptr, chunk, chunk_size, num_pairs, num_experts, SUB: tl.constexpr, E_PAD: tl.constexpr):
    counts = tl.zeros([E_PAD], tl.int32)
    end = tl.minimum(chunk * chunk_size + chunk_size, num_pairs)
    for start in range(chunk * chunk_size, end, SUB):
        _, _, hot = _one_hot(ids_ptr, start, end, num_experts, SUB, E_PAD)
        counts += tl.sum(hot, 0)
    return counts


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, chunk_size, num_pairs, num_experts, SUB: tl.constexpr, E_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    counts = _chunk_counts(ids_ptr, chunk, chunk_size, num_pairs, num_experts, SUB, E_PAD)
    tl.store(counts_ptr + chunk * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, block_experts_ptr, chunk_size, num_chunks, num_pairs,
                  num_experts, num_blocks, BLOCK_M: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
                  STEP_BLOCKS: tl.constexpr, ONE_CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    if ONE_CHUNK:
        total = _chunk_counts(ids_ptr, 0, chunk_size, num_pairs, num_experts, SUB, E_PAD)
        before = tl.zeros([E_PAD], tl.int32)
    else:
        total = tl.zeros([E_PAD], tl.int32)
        before = tl.zeros([E_PAD], tl.int32)  # pairs of each expert in the chunks before this one
        for other in range(num_chunks):
            counts = tl.load(counts_ptr + other * E_PAD + experts)
            total += counts
            before += tl.where(other < chunk, counts, 0)
    blocks = (total + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)  # expert e owns blocks [block_end - blocks, block_end)
    first_row = (block_end - blocks) * BLOCK_M
    next_row = first_row + before
    end = tl.minimum(chunk * chunk_size + chunk_size, num_pairs)
    for start in range(chunk * chunk_size, end, SUB):
        pairs, valid, hot = _one_hot(ids_ptr, start, end, num_experts, SUB, E_PAD)
        rank = tl.cumsum(hot, 0) - hot  # earlier pairs of the same expert in this step
        row = tl.sum(hot * (rank + next_row[None, :]), 1)
        tl.store(sorted_ptr + row, pairs, mask=valid)
        next_row += tl.sum(hot, 0)
    filled_end = first_row + total  # rows past an expert's pairs, up to its next block edge, are padding
    for b0 in range(chunk * STEP_BLOCKS, num_blocks, num_chunks * STEP_BLOCKS):
        block = b0 + tl.arange(0, STEP_BLOCKS)
        owner = tl.sum((block_end[None, :] <= block[:, None]).to(tl.int32), 1)  # E_PAD past the used blocks
        owner_end = tl.sum(tl.where(owner[:, None] == experts[None, :], filled_end[None, :], 0), 1)
        inside = block < num_blocks
        tl.store(block_experts_ptr + block, tl.where(owner < num_experts, owner, -1), mask=inside)
        rows = block[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        padding = tl.full([STEP_BLOCKS, BLOCK_M], -1, tl.int32)
        tl.store(sorted_ptr + rows, padding, mask=inside[:, None] & (rows >= owner_end[:, None]))


def align_tokens(expert_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int, *,
                 min_chunk: int = MIN_CHUNK) -> AlignedPairs:
    """expert_ids: [T, k] int32 -> :class:`AlignedPairs` of ``num_blocks`` blocks (the static bound).
    ``min_chunk`` (pairs per chunk at least) lets tests reach several chunks with few pairs."""
    device = expert_ids.device
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_pairs = expert_ids.numel()
    if num_blocks == 0:
        return AlignedPairs(sorted_pairs, block_experts)
    chunk_size = max(min_chunk, triton.next_power_of_2(triton.cdiv(num_pairs, MAX_CHUNKS)))
    num_chunks = triton.cdiv(num_pairs, chunk_size)
    e_pad = experts_padded(num_experts)
    counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
    if num_chunks > 1:
        _count_kernel[(num_chunks,)](expert_ids, counts, chunk_size, num_pairs, num_experts, SUB=SUB, E_PAD=e_pad)
    _place_kernel[(num_chunks,)](
        expert_ids, counts, sorted_pairs, block_experts, chunk_size, num_chunks, num_pairs, num_experts, num_blocks,
        BLOCK_M=block_m, SUB=SUB, E_PAD=e_pad, STEP_BLOCKS=STEP_BLOCKS, ONE_CHUNK=num_chunks == 1,
        num_warps=8 if e_pad >= 256 else 4,
    )
    return AlignedPairs(sorted_pairs, block_experts)
