"""Async scheduling of speculative decode steps (runtime/overlap.py, metadata.Outcomes) on the CPU:
the engine launches step n+1 behind a step that verifies drafts, with its inputs built for both
outcomes and picked on the device. Greedy tokens must be those of plain decoding and of
synchronous speculation, token for token, with the same draft counts and no block left behind."""

from types import SimpleNamespace

import pytest
import torch
from test_async_scheduling import run_engine

from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.models.loader import load_model
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime import metadata as metadata_module
from flashdsa.runtime.cuda_graphs import DecodeGraphs
from flashdsa.runtime.engine import EngineConfig, LLMEngine
from flashdsa.runtime.metadata import BatchMetadata, Outcomes
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.scheduler import ScheduledChunk, Scheduler

SETTINGS = {"plain": (0, False), "speculative": (1, False), "speculative+async": (1, True)}


@pytest.fixture(scope="module")
def default_model():
    """The embedded default model with its trained MTP layer (accepts about 2 drafts in 3)."""
    from transformers import AutoTokenizer

    return load_model(DEFAULT_MODEL, mode="reference", mtp=True), AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    """A shrunk tiny checkpoint with a random MTP layer (nearly every draft rejected)."""
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mtp"), shrink=True, seed=7, mtp=True)
    return load_model(path, mode="reference", mtp=True), AutoTokenizer.from_pretrained(path)


@pytest.fixture
def probes(monkeypatch):
    """What the overlapped speculative path did: launches (overlapped steps), behind (chunks
    launched behind the step verifying their draft), accepted (of which ran one position on),
    held (sequences with a draft in flight left out of a step), resolved (chunks planned behind a
    draft that ran synchronously after all), and the longest context any launched chunk could
    reach against its request's end (prompt + max_tokens)."""
    counts = dict(launches=0, behind=0, accepted=0, held=0, resolved=0, overrun=0)
    launch, schedule, apply, resolve = LLMEngine._launch, Scheduler.schedule, Outcomes.apply, ScheduledChunk.resolve

    def counting_launch(self, chunks, previous):
        for c in chunks:  # the accepted variant's context: one past the planned one
            end = c.seq.num_prompt_tokens + c.seq.max_tokens
            counts["overrun"] = max(counts["overrun"], c.start + c.num_run + c.pending_draft - end)
        in_flight = launch(self, chunks, previous)
        counts["launches"] += in_flight is not None
        counts["behind"] += sum(c.pending_draft for c in chunks) if in_flight is not None else 0
        return in_flight

    def counting_schedule(self):
        chunks = schedule(self)
        scheduled = {id(c.seq) for c in chunks}
        counts["held"] += sum(s.num_pending_drafts > 0 and id(s) not in scheduled for s in self.running)
        return chunks

    def counting_apply(self, meta):
        counts["accepted"] += int(torch.cat([self.accepted, self.accepted.new_zeros(1)])[self.rows].sum())
        return apply(self, meta)

    def counting_resolve(self):
        counts["resolved"] += self.pending_draft
        resolve(self)

    monkeypatch.setattr(LLMEngine, "_launch", counting_launch)
    monkeypatch.setattr(ScheduledChunk, "resolve", counting_resolve)
    monkeypatch.setattr(Scheduler, "schedule", counting_schedule)
    monkeypatch.setattr(metadata_module.Outcomes, "apply", counting_apply)
    return counts


def _requests(tok):
    """Greedy requests of different lengths arriving over several steps (so prefills join steps
    with drafts in flight), sharing a two-block prefix (prefix hits), with max_tokens of both
    parities (the last pair may overrun it)."""
    text = ("ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is "
            "the sun. Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.\n") * 2
    ids = tok(text)["input_ids"]
    greedy = dict(temperature=0, ignore_eos=True)
    reqs = [(i // 2, f"r{i}", ids[: 140 + 11 * i], SamplingParams(max_tokens=13 + 4 * i + i % 2, **greedy))
            for i in range(5)]
    return reqs + [(1, "short", ids[:9], SamplingParams(max_tokens=3, **greedy))]


def _with_stop_string(model_tok, requests):
    """``requests`` and one more that a stop string (from its plain greedy text) ends early."""
    prompt, params = requests[0][2][:40], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = run_engine(_engine(model_tok, "plain"), [(0, "x", prompt, params)])["x"]["text"]
    return requests + [(2, "stop", prompt, SamplingParams(temperature=0, max_tokens=40, stop=[text[15:19]]))]


def _engine(model_tok, setting: str, **options) -> LLMEngine:
    spec, overlapped = SETTINGS[setting]
    config = dict(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=256, speculative_tokens=spec,
                  async_scheduling=overlapped)
    return LLMEngine(*model_tok, EngineConfig(**{**config, **options}))


def _run_all(model_tok, requests, **options) -> tuple[dict, dict]:
    """Each setting's results and engine."""
    results, engines = {}, {}
    for setting in SETTINGS:
        engines[setting] = _engine(model_tok, setting, **options)
        results[setting] = run_engine(engines[setting], requests)
    return results, engines


def test_overlapped_speculation_gives_the_plain_greedy_tokens_on_the_default_model(default_model, probes):
    requests = _with_stop_string(default_model, _requests(default_model[1]))
    results, engines = _run_all(default_model, requests)
    for setting in ("speculative", "speculative+async"):
        assert results[setting] == results["plain"], setting
    sync, overlapped = engines["speculative"], engines["speculative+async"]
    assert overlapped.num_draft_tokens == sync.num_draft_tokens
    assert overlapped.num_accepted_tokens == sync.num_accepted_tokens
    assert sync.num_accepted_tokens > sync.num_draft_tokens / 3
    assert results["plain"]["stop"]["end"][0] == "stop" and len(results["plain"]["stop"]["tokens"]) < 40
    assert all(len(results["plain"][f"r{i}"]["tokens"]) == 13 + 4 * i + i % 2 for i in range(5))
    # the overlapped path ran behind drafts, took both outcomes, held back last pairs, never overran
    assert probes["launches"] > 10 and probes["behind"] > 20, probes
    assert 0 < probes["accepted"] < probes["behind"] and probes["held"] > 0 and probes["overrun"] <= 0, probes
    assert overlapped.scheduler.prefix_hits > 0
    for engine in engines.values():
        assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.running


def test_overlapped_speculation_survives_preemption_and_keeps_no_block(default_model, probes):
    """A cache too small for every sequence: sequences are preempted with their draft in flight."""
    results, engines = _run_all(default_model, _requests(default_model[1]), num_blocks=9)
    assert results["speculative+async"] == results["plain"]
    assert engines["speculative+async"].scheduler.num_preemptions > 0 and probes["behind"] > 10
    assert engines["speculative+async"].block_manager.num_used_blocks == 0


def test_aborts_with_drafts_in_flight_free_everything(default_model, probes):
    requests = _requests(default_model[1])
    want = run_engine(_engine(default_model, "plain"), requests)
    engine = _engine(default_model, "speculative+async")
    got = run_engine(engine, requests, abort_at={"r0": 4, "r3": 7})
    for rid in ("r0", "r3"):
        assert got[rid]["end"] is None and got[rid]["tokens"] == want[rid]["tokens"][: len(got[rid]["tokens"])]
    for rid in set(want) - {"r0", "r3"}:
        assert got[rid] == want[rid], rid
    assert engine.num_aborted == 2 and engine.block_manager.num_used_blocks == 0 and probes["behind"] > 5


def test_requests_that_need_the_host_run_synchronously_among_overlapped_ones(default_model, probes):
    """A seeded sampled request and one asking logprobs join greedy ones: the steps that hold them
    run synchronously (their chunks with drafts in flight settled first); every request ends as
    with synchronous speculation."""
    requests = _requests(default_model[1])[:3]
    requests += [(4, "sampled", requests[0][2][:50], SamplingParams(temperature=0.8, seed=3, max_tokens=4)),
                 (12, "logprobs", requests[1][2][:60], SamplingParams(temperature=0, max_tokens=3, logprobs=2))]
    want = run_engine(_engine(default_model, "speculative"), requests)
    engine = _engine(default_model, "speculative+async")
    assert run_engine(engine, requests) == want
    assert probes["behind"] > 5 and probes["resolved"] > 0 and engine.block_manager.num_used_blocks == 0, probes


def test_unseeded_sampled_requests_overlap_their_speculative_steps(default_model, probes):
    """Sampled requests without a seed verify their drafts on the device (rejection sampling there),
    so their decode steps run behind each other; every request gets its max_tokens, drafts are
    accepted about as often as under greedy decoding, and no block stays behind."""
    requests = [(at, rid, prompt, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=params.max_tokens,
                                                 ignore_eos=True))
                for at, rid, prompt, params in _requests(default_model[1])]
    engine = _engine(default_model, "speculative+async")
    results = run_engine(engine, requests)
    for _, rid, _, params in requests:
        assert len(results[rid]["tokens"]) == params.max_tokens and results[rid]["end"][0] == "length", rid
    assert probes["launches"] > 10 and probes["behind"] > 20 and 0 < probes["accepted"] < probes["behind"], probes
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.running


def test_tiny_checkpoint_decodes_the_same_with_overlapped_speculation(tiny_mtp, probes):
    _, tok = tiny_mtp
    prompts = [[(11 * i + 3 * j) % 300 + 4 for j in range(20 + 37 * i)] for i in range(4)]
    requests = [(i, f"p{i}", p, SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True))
                for i, p in enumerate(prompts)]
    results, engines = _run_all(tiny_mtp, requests, num_blocks=16, max_num_batched_tokens=48)
    assert results["speculative+async"] == results["speculative"] == results["plain"]
    assert engines["speculative+async"].num_draft_tokens == engines["speculative"].num_draft_tokens > 0
    assert probes["behind"] > 10 and engines["speculative+async"].block_manager.num_used_blocks == 0


def test_outcomes_give_each_sequence_the_metadata_of_where_it_stands():
    """Metadata built for rejected drafts, then each sequence's variant picked by random flags,
    equals metadata built from where each sequence really stands; rows -1 never move."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        batch, width = 7, 4
        tables = torch.randperm(40, generator=gen)[: batch * width].view(batch, width).int()
        counts = torch.randint(1, 3, (batch,), generator=gen).tolist()
        starts = torch.randint(0, width * 64 - 3, (batch,), generator=gen).tolist()
        accepted = torch.rand(5, generator=gen) < 0.5
        rows = [int(r) if r < 5 else -1 for r in torch.randint(0, 8, (batch,), generator=gen)]
        meta = BatchMetadata.for_step(starts, counts, tables, torch.arange(sum(counts)))
        outcomes, bounded = Outcomes.of(meta, rows, accepted)
        got = outcomes.apply(bounded)
        moved = [s + (r >= 0 and bool(accepted[r])) for s, r in zip(starts, rows)]
        want = BatchMetadata.for_step(moved, counts, tables, torch.arange(sum(counts)))
        for name in ("positions", "slot_mapping", "context_lens", "seq_ids", "block_tables"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (trial, name)
        assert all(b >= w for b, w in zip(bounded.context_lens_host, want.context_lens_host))
        assert bounded.max_context_len >= want.max_context_len


def _with_eager_graphs(engine: LLMEngine, monkeypatch) -> DecodeGraphs:
    """Give ``engine``'s runner decode graphs whose "replay" runs the captured forward eagerly (the
    CPU has no CUDA graphs): their static inputs, staging and in-graph variant pick run as on a GPU."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # the CPU build cannot pin
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.caches, engine.config.max_num_seqs, engine.max_model_len,
                          runner.device, speculative=True)
    graphs._fill_padding(0, graphs.max_batch)
    graphs.inputs.copy_(graphs.staging)
    for b in graphs.buckets:
        graphs.graphs[b] = SimpleNamespace(replay=lambda b=b: graphs.outputs.__setitem__(b, graphs._forward(b)))
        graphs.draft_graphs[b] = SimpleNamespace(
            replay=lambda b=b: graphs.draft_outputs.__setitem__(b, graphs._draft_forward(b)))
    runner.graphs = graphs
    return graphs


def test_decode_graph_inputs_pick_each_sequences_variant(default_model, monkeypatch):
    """The CUDA-graph path's static buffer (both variants in one upload, the pick inside the
    graph, padding rows), replayed eagerly: the tokens of plain decoding, the synchronous counts."""
    requests = _requests(default_model[1])
    want = run_engine(_engine(default_model, "plain"), requests)
    counts = {}
    for setting in ("speculative", "speculative+async"):
        engine = _engine(default_model, setting)
        graphs = _with_eager_graphs(engine, monkeypatch)
        replays, replay = [], graphs.replay
        monkeypatch.setattr(graphs, "replay", lambda *a: replays.append(len(a) > 3 and a[3] is not None) or replay(*a))
        assert run_engine(engine, requests) == want, setting
        counts[setting] = (engine.num_draft_tokens, engine.num_accepted_tokens, len(replays))
        assert engine.block_manager.num_used_blocks == 0
    assert counts["speculative+async"] == counts["speculative"] and counts["speculative"][2] > 10
    assert sum(replays) > 10  # overlapped replays with both variants
