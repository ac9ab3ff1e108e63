"""Block manager: prefix sharing by chained hash, reference counts, LRU eviction, no leaks."""

import random

from flashdsa.runtime.block_manager import BlockManager
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.sequence import Sequence

B = 64


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(), max_tokens=16)


def run_prefill(bm, seq):
    """Give seq blocks for all its tokens, mark them computed, offer them to the cache."""
    bm.acquire_prefix(seq)
    assert bm.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.register_computed(seq)


def test_shared_prefix_reuses_full_blocks_and_counts_references():
    bm = BlockManager(16)
    prompt = list(range(1000, 1000 + 3 * B + 5))
    a = make_seq(prompt, "a")
    run_prefill(bm, a)
    b = make_seq(prompt[: 2 * B] + [7] * 70, "b")
    assert bm.acquire_prefix(b) == 2 * B
    assert b.block_table == a.block_table[:2]
    assert [bm.allocator.refcount(x) for x in b.block_table] == [2, 2]
    bm.free(a)
    assert [bm.allocator.refcount(x) for x in b.block_table] == [1, 1]
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_fully_cached_prompt_still_leaves_a_token_to_compute():
    bm = BlockManager(8)
    prompt = list(range(2 * B))
    run_prefill(bm, make_seq(prompt, "a"))
    again = make_seq(prompt, "b")
    assert bm.acquire_prefix(again) == B  # not 2 * B: the last token must run for logits


def test_different_earlier_block_means_no_hit_for_equal_later_block():
    bm = BlockManager(8)
    run_prefill(bm, make_seq([1] * B + [2] * B, "a"))
    other = make_seq([3] * B + [2] * B + [5], "b")
    assert bm.acquire_prefix(other) == 0


def test_freed_cached_blocks_survive_until_evicted_lru_tail_first():
    bm = BlockManager(4)
    a = make_seq(list(range(3 * B)) + [9], "a")
    run_prefill(bm, a)
    head = a.block_table[:3]
    bm.free(a)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 4
    filler = make_seq([42] * (2 * B), "f")  # needs 2 blocks: 1 never-cached free + 1 evicted
    assert bm.grow(filler, len(filler))
    survivors = [h for h in head if h in bm.block_to_hash]
    assert survivors == head[:2]  # the tail block went first
    bm.free(filler)
    again = make_seq(list(range(3 * B)) + [9], "c")
    assert bm.acquire_prefix(again) == 2 * B


def test_grow_refuses_without_taking_anything_when_short():
    bm = BlockManager(2)
    seq = make_seq(list(range(10)))
    assert not bm.grow(seq, 3 * B)
    assert seq.block_table == [] and bm.num_used_blocks == 0


def test_random_workload_never_leaks_or_double_frees():
    rng = random.Random(0)
    bm = BlockManager(24)
    prefixes = [[rng.randrange(50) for _ in range(2 * B)] for _ in range(3)]
    live = []
    for step in range(300):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 4):
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        tokens = rng.choice(prefixes)[: rng.randrange(1, 2 * B)] + [rng.randrange(50) for _ in range(rng.randrange(1, 90))]
        seq = make_seq(tokens, f"s{step}")
        bm.acquire_prefix(seq)
        if bm.grow(seq, len(seq)):
            seq.num_computed_tokens = len(seq)
            bm.register_computed(seq)
            live.append(seq)
        else:
            bm.free(seq)
        held = sum(len(s.block_table) for s in live)
        shared = held - len({b for s in live for b in s.block_table})
        assert bm.num_used_blocks == held - shared
    for seq in live:
        bm.free(seq)
    assert bm.num_used_blocks == 0
    assert bm.allocator.num_used == len(bm.evictable)


def test_stateful_prefix_hits_end_at_a_snapshot_and_snapshots_go_with_their_block():
    """Models with per-sequence state (2 running slots, 1 snapshot slot, slot 2 the graphs' padding)."""
    bm = BlockManager(6, num_state_slots=2, num_snapshot_slots=1)
    prompt = list(range(1000, 1000 + 3 * B + 5))
    a = make_seq(prompt, "a")
    bm.acquire_prefix(a)
    assert bm.grow(a, len(a)) and a.state_slot == 0
    assert bm.snapshot_boundary(a) == 3 * B and bm.reserve_snapshot(a) == 3
    assert bm.reserve_snapshot(a) == -1  # one reservation a sequence
    a.num_computed_tokens = 3 * B
    bm.register_computed(a)  # the step that ended at the boundary ran: the snapshot is offered
    assert bm.snapshot_of == {a.block_hashes[2]: 3} and a.snapshot_to == -1
    bm.free(a)
    assert bm.free_state_slots == [1, 0]
    longer = make_seq(prompt + [5] * 70, "b")
    assert bm.acquire_prefix(longer) == 3 * B and longer.restore_from == 3
    shorter = make_seq(prompt[: 2 * B + 10], "c")  # its cached chain has no snapshot: nothing to resume from
    assert bm.acquire_prefix(shorter) == 0 and shorter.restore_from == -1
    bm.free(longer)
    filler = make_seq(range(5000, 5000 + 6 * B), "d")  # needs every block: evicts a's, and its snapshot
    bm.acquire_prefix(filler)
    assert bm.grow(filler, len(filler))
    assert not bm.snapshot_of and bm.free_snapshot_slots == [3]
    assert bm.reserve_snapshot(filler) == 3
    bm.free(filler)  # aborted before the step ran: the reservation comes back
    assert bm.free_snapshot_slots == [3] and bm.free_state_slots == [1, 0]
