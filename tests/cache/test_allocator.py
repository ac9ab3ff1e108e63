"""BlockAllocator invariants under random alloc/free/incref sequences, and slot mapping."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdsa.runtime.cache.allocator import BlockAllocator, OutOfBlocks, slot_mapping

OPS = st.lists(st.tuples(st.sampled_from(["allocate", "free", "incref"]), st.integers(0, 1000)), max_size=80)


def check_invariants(alloc: BlockAllocator, handles: list[int]) -> None:
    """handles: one entry per owner reference currently held (a shared block appears several times)."""
    for block in range(alloc.num_blocks):
        assert alloc.refcount(block) == handles.count(block)
    assert alloc.num_used == len(set(handles))
    assert alloc.num_free + alloc.num_used == alloc.num_blocks


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(0, 6), ops=OPS)
def test_random_sequences_keep_refcounts_consistent_and_return_every_block(num_blocks, ops):
    alloc, handles = BlockAllocator(num_blocks), []
    for op, pick in ops:
        if op == "allocate":
            if alloc.num_free == 0:
                with pytest.raises(OutOfBlocks):
                    alloc.allocate()
                continue
            block = alloc.allocate()
            assert block not in handles  # never owned twice
            handles.append(block)
        elif handles:
            block = handles[pick % len(handles)]
            if op == "incref":
                alloc.incref(block)
                handles.append(block)
            else:
                handles.remove(block)
                assert alloc.free(block) == (block not in handles)
        check_invariants(alloc, handles)
    for block in list(handles):
        handles.remove(block)
        alloc.free(block)
    check_invariants(alloc, handles)
    assert alloc.num_free == num_blocks
    assert sorted(alloc.allocate() for _ in range(num_blocks)) == list(range(num_blocks))


def test_misuse_raises_clear_errors():
    alloc = BlockAllocator(2)
    block = alloc.allocate()
    alloc.free(block)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(1 - block)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.incref(block)
    for bad in (-1, 2, 1.0, "0"):
        with pytest.raises(ValueError, match="block must be"):
            alloc.refcount(bad)
    alloc.allocate(), alloc.allocate()
    with pytest.raises(OutOfBlocks):
        alloc.allocate()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(-1)


def test_shared_block_is_freed_only_by_its_last_owner():
    alloc = BlockAllocator(1)
    block = alloc.allocate()
    alloc.incref(block)
    assert alloc.refcount(block) == 2 and not alloc.free(block) and alloc.num_free == 0
    assert alloc.free(block) and alloc.num_free == 1 and alloc.refcount(block) == 0


def test_slot_mapping_worked_example():
    slots = slot_mapping([7, 2, 5], [0, 63, 64, 130, 191], block_size=64)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [7 * 64, 7 * 64 + 63, 2 * 64, 5 * 64 + 2, 5 * 64 + 63]
    assert slot_mapping([7], []).tolist() == []


@settings(max_examples=40, deadline=None)
@given(
    table=st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True),
    block_size=st.sampled_from([1, 4, 16, 64]),
    data=st.data(),
)
def test_slot_mapping_matches_the_enumerated_slots_of_the_table(table, block_size, data):
    every_slot = [b * block_size + o for b in table for o in range(block_size)]
    positions = data.draw(st.lists(st.integers(0, len(every_slot) - 1), max_size=20))
    got = slot_mapping(torch.tensor(table, dtype=torch.int32), torch.tensor(positions, dtype=torch.int64), block_size)
    assert got.tolist() == [every_slot[p] for p in positions]


@pytest.mark.parametrize("table, positions, match", [
    ([3, 4], [128], "positions"),
    ([3, 4], [-1], "positions"),
    ([3, -1], [70], "negative"),
    ([[3, 4]], [0], "block_table"),
    ([3, 4], [[0]], "positions"),
])
def test_slot_mapping_rejects_positions_outside_the_table(table, positions, match):
    with pytest.raises(ValueError, match=match):
        slot_mapping(table, positions)
