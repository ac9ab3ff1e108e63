"""Value checks (the ones that read tensors back to the host) and the block that trusts values."""

from __future__ import annotations

import pytest
import torch

from flashdsa.runtime.cache import write_indexer_cache
from flashdsa.runtime.checks import can_check_values, trusted_values
from flashdsa.runtime.indexer import indexer_topk


def test_trusted_values_skips_value_checks_only_inside_the_block():
    logits = torch.randn(2, 50)
    bad_ends = torch.tensor([50, 60], dtype=torch.int32)
    starts = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="ends must be <= 50"):
        indexer_topk(logits, 4, starts, bad_ends)
    with trusted_values():
        assert not can_check_values(torch.device("cpu"))
        with trusted_values():  # nests
            pass
        assert not can_check_values(torch.device("cpu"))
    assert can_check_values(torch.device("cpu"))
    with pytest.raises(ValueError, match="ends must be <= 50"):
        indexer_topk(logits, 4, starts, bad_ends)


def test_trusted_cache_write_still_skips_out_of_range_slots():
    """Inside the block the slot range is not read back, and the backend still writes nothing out of range."""
    pool = torch.zeros(2, 64, 1, 132, dtype=torch.uint8)
    keys = torch.randn(3, 128)
    slots = torch.tensor([5, 128, 200], dtype=torch.int64)  # two beyond the pool's 128 slots
    with pytest.raises(ValueError, match="slot_mapping has slot 200"):
        write_indexer_cache(keys, pool, slots)
    with trusted_values():
        write_indexer_cache(keys, pool, slots)
    expected = torch.zeros_like(pool)
    write_indexer_cache(keys[:1], expected, slots[:1])
    assert torch.equal(pool, expected)
