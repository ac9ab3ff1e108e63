"""Scheduler: token budget with chunked prefill, running cap, preemption by recompute."""

from flashdsa.runtime.block_manager import BlockManager
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.scheduler import Scheduler, SchedulerConfig
from flashdsa.runtime.sequence import Sequence, SequenceStatus


def make(num_blocks, max_seqs=8, budget=256):
    return Scheduler(SchedulerConfig(max_seqs, budget), BlockManager(num_blocks, enable_prefix_caching=False))


def add(sched, rid, n):
    seq = Sequence(rid, [(i * 7 + len(rid)) % 100 for i in range(n)], SamplingParams(), max_tokens=1000)
    sched.add(seq)
    return seq


def advance(chunks):
    """What the engine does after a step: tokens computed, a token sampled at the end."""
    for c in chunks:
        c.seq.num_computed_tokens += c.num_tokens
        if c.samples:
            c.seq.append_token(1)


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    sched = make(16, budget=100)
    seq = add(sched, "a", 250)
    sizes = []
    for _ in range(3):
        chunks = sched.schedule()
        sizes.append([(c.start, c.num_tokens, c.samples) for c in chunks])
        advance(chunks)
    assert sizes == [[(0, 100, False)], [(100, 100, False)], [(200, 50, True)]]
    assert [(c.start, c.num_tokens) for c in sched.schedule()] == [(250, 1)]
    assert seq.num_output_tokens == 1


def test_decodes_and_prefill_chunks_share_a_step_and_never_exceed_the_budget():
    sched = make(32, budget=64)
    add(sched, "a", 10)
    add(sched, "b", 10)
    advance(sched.schedule())
    add(sched, "c", 200)
    chunks = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [("a", 1), ("b", 1), ("c", 62)]
    assert sum(c.num_tokens for c in chunks) <= 64


def test_running_sequences_are_capped():
    sched = make(32, max_seqs=2)
    for rid in "abc":
        add(sched, rid, 5)
    chunks = sched.schedule()
    assert [c.seq.request_id for c in chunks] == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_out_of_blocks_preempts_the_newest_and_resumes_it_later():
    sched = make(2, budget=512)
    a, b = add(sched, "a", 64), add(sched, "b", 60)
    advance(sched.schedule())  # both prefilled: a has 65 tokens (needs a 2nd block), b 61
    chunks = sched.schedule()
    assert [c.seq.request_id for c in chunks] == ["a"]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and len(b) == 61  # its sampled token is kept and recomputed
    advance(chunks)
    sched.finish(a)
    chunks = sched.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in chunks] == [("b", 0, 61, True)]


def test_abort_frees_blocks_wherever_the_request_is():
    sched = make(8)
    add(sched, "a", 100)
    add(sched, "b", 10)
    sched.schedule()
    add(sched, "c", 10)
    for rid in ("a", "c", "b"):
        assert sched.abort(rid).finish_reason == "abort"
    assert sched.abort("unknown") is None
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0


def test_a_token_in_flight_counts_in_the_plan_and_a_last_one_is_not_scheduled():
    """Async scheduling: a sequence whose sampled token is still on the device runs that token
    next; one whose token in flight is its max_tokens-th gets nothing, and may still be preempted;
    finishing it then (it waits) frees its blocks."""
    for num_blocks in (4, 2):
        sched = make(num_blocks)
        b, a = add(sched, "b", 64), add(sched, "a", 64)
        a.max_tokens = 1
        for c in sched.schedule():  # what a launched step does: computed, one token in flight
            c.seq.num_computed_tokens += c.num_tokens
            c.seq.num_pending_tokens = 1
        chunks = sched.schedule()
        assert [(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in chunks] == [("b", 64, 1, True)]
        assert a.status == (SequenceStatus.RUNNING if num_blocks == 4 else SequenceStatus.WAITING)
    a.append_token(1)  # the engine reads a's token: its last
    a.num_pending_tokens = 0
    a.finish("length")
    sched.finish(a)
    assert not sched.waiting and sched.running == [b] and sched.block_manager.num_used_blocks == 2
