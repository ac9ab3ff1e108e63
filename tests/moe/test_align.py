"""align_tokens (reference backend) against its contract; the static block bound; bad arguments.
The triton backend is checked against the same contract in test_triton_moe.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from flashdsa.runtime.moe import align_tokens, max_blocks
from moe_cases import alignment_cases, check_alignment, generator


@pytest.mark.parametrize("name, ids, num_experts, block_m", alignment_cases(),
                         ids=lambda c: c if isinstance(c, str) else "")
def test_reference_alignment_keeps_its_contract(name, ids, num_experts, block_m):
    check_alignment(ids, num_experts, block_m, align_tokens(ids, num_experts, block_m, backend="reference"))


def test_check_alignment_catches_a_moved_pair():
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    aligned = align_tokens(ids, 2, 2, backend="reference")
    aligned.sorted_pairs[[0, 1]] = aligned.sorted_pairs[[1, 0]]  # expert 0's pairs out of order
    with pytest.raises(AssertionError):
        check_alignment(ids, 2, 2, aligned)


def worst_case_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most blocks any split of the pairs over the experts fills (brute force)."""
    best = 0
    for counts in itertools.product(range(num_pairs + 1), repeat=num_experts):
        if sum(counts) == num_pairs:
            best = max(best, sum(-(-c // block_m) for c in counts))
    return best


@pytest.mark.parametrize("num_experts", [1, 2, 3, 4])
@pytest.mark.parametrize("block_m", [1, 2, 4, 8])
def test_max_blocks_is_the_tight_bound(num_experts, block_m):
    for num_pairs in range(0, 11):
        assert max_blocks(num_pairs, num_experts, block_m) == worst_case_blocks(num_pairs, num_experts, block_m)


@pytest.mark.parametrize("call, message", [
    (lambda: align_tokens(torch.zeros(2, 2, dtype=torch.int64), 4, 16), "expert_ids must be int32 [T, top_k >= 1]"),
    (lambda: align_tokens(torch.zeros(2, 0, dtype=torch.int32), 4, 16), "expert_ids must be int32 [T, top_k >= 1]"),
    (lambda: align_tokens(torch.zeros(4, dtype=torch.int32), 4, 16), "expert_ids must be int32 [T, top_k >= 1]"),
    (lambda: align_tokens(torch.zeros(2, 2, dtype=torch.int32), 0, 16), "num_experts must be an int in [1, inf]"),
    (lambda: align_tokens(torch.zeros(2, 2, dtype=torch.int32), 4, 24), "block_m must be a power of two"),
    (lambda: align_tokens(torch.zeros(2, 2, dtype=torch.int32), 4, 512), "block_m must be an int in [1, 256]"),
    (lambda: align_tokens(torch.zeros(2, 2, dtype=torch.int32), 4, 16, backend="cuda"), "backend 'cuda' cannot run"),
])
def test_bad_arguments_name_themselves(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)
