"""The static layout of (token, slot) pairs aligned by expert, shared by every MoE backend.

A pair is the flat index ``p = t * top_k + j`` of token t's j-th chosen expert. Aligned, the
pairs of expert 0 come first, then those of expert 1, ..., each expert's run in ascending pair
order and padded with -1 to a whole number of ``block_m``-row blocks, so one block of rows
belongs to one expert. The used blocks are followed by unused ones (expert -1, rows -1) up to
:func:`max_blocks`, which depends only on the shapes: the layout has a size known on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AlignedPairs(NamedTuple):
    """sorted_pairs: [num_blocks * block_m] int32 pair ids, -1 for padding;
    block_experts: [num_blocks] int32 expert of each block, -1 for an unused block."""

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing of ``num_pairs`` pairs over ``num_experts`` experts.

    Expert e with c_e pairs fills ceil(c_e / block_m) blocks, which is at most c_e and at most
    (c_e + block_m - 1) / block_m; at most min(E, P) experts are non-empty. Summing either bound:
    min(P, (P + min(E, P) * (block_m - 1)) // block_m).
    """
    busy = min(num_experts, num_pairs)
    return min(num_pairs, (num_pairs + busy * (block_m - 1)) // block_m)
