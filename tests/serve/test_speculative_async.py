"""Async scheduling of speculative decode steps (runtime/overlap.py, metadata.advance) on the CPU:
the engine launches step n+1 behind a step that verifies drafts, with its inputs built as if every
draft were rejected and moved on the device where one held. Greedy tokens must be those of plain decoding and of
synchronous speculation, token for token, with the same draft counts and no block left behind."""

from types import SimpleNamespace

import pytest
import torch
from test_async_scheduling import run_engine

from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.models.loader import load_model
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.cache.layout import BLOCK_SIZE
from flashdsa.runtime import model_runner as runner_module
from flashdsa.runtime.cuda_graphs import DecodeGraphs
from flashdsa.runtime.engine import EngineConfig, LLMEngine
from flashdsa.runtime.metadata import BatchMetadata, advance
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.scheduler import ScheduledChunk, Scheduler
from flashdsa.runtime.transfer import TokenFill

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
    launch, schedule, resolve = LLMEngine._launch, Scheduler.schedule, ScheduledChunk.resolve

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

    def counting_advance(meta, moved, *args):
        counts["accepted"] += int(moved.sum())
        return advance(meta, moved, *args)

    def counting_resolve(self):
        counts["resolved"] += self.pending_draft
        resolve(self)

    monkeypatch.setattr(LLMEngine, "_launch", counting_launch)
    monkeypatch.setattr(ScheduledChunk, "resolve", counting_resolve)
    monkeypatch.setattr(Scheduler, "schedule", counting_schedule)
    monkeypatch.setattr(runner_module, "advance", counting_advance)
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


def _starts(batch: int, width: int, gen: torch.Generator) -> list[int]:
    """Random start positions in ``width`` blocks, half of them at a block's last two positions (a
    move then crosses into the next block)."""
    starts = torch.randint(0, width * BLOCK_SIZE - 4, (batch,), generator=gen)
    edge = (torch.randint(1, width, (batch,), generator=gen) * BLOCK_SIZE - torch.randint(1, 3, (batch,), generator=gen))
    return torch.where(torch.rand(batch, generator=gen) < 0.5, edge, starts).tolist()


def _fill(batch: int, counts: list[int], gen: torch.Generator, source: torch.Tensor, rows: int) -> TokenFill:
    """A step behind a speculative one of ``rows`` rows whose verdict is ``source`` (``[5 rows]``,
    ``DeviceVerdict.packed``): a random subset of the sequences (a random row each) takes its last
    token (and its draft, where it runs two), and whether to move, from there."""
    row_of = [int(r) if r < rows else -1 for r in torch.randperm(max(rows, batch) + 2, generator=gen)[:batch]]
    ids, moves = [], []
    for count, row in zip(counts, row_of):
        ids += ([3 * rows + row, 4 * rows + row] if row >= 0 else [-1, -1])[2 - count :]  # last token, draft
        moves.append(2 * rows + row if row >= 0 else -1)
    return TokenFill(source, ids, moves)


def _verdict(rows: int, gen: torch.Generator, out: torch.Tensor) -> torch.Tensor:
    """A packed verdict of ``rows`` rows (random tokens, random accepted flags) written into ``out``."""
    packed = torch.randint(10, 1000, (5 * rows,), generator=gen)
    packed[2 * rows : 3 * rows] = (torch.rand(rows, generator=gen) < 0.5).long()
    return out[: 5 * rows].copy_(packed)


def _expected(fill: TokenFill, starts: list[int], counts: list[int], tables: torch.Tensor, host_ids: torch.Tensor):
    """Input ids and metadata of the step as each sequence really stands (built on the host from
    scratch, as ``metadata.Outcomes`` built the accepted variant before the device did)."""
    moved = [m >= 0 and bool(fill.source[m]) for m in fill.moves]
    ids = torch.tensor([int(fill.source[i]) if i >= 0 else int(h) for i, h in zip(fill.ids, host_ids)])
    meta = BatchMetadata.for_step([s + m for s, m in zip(starts, moved)], counts, tables, torch.arange(sum(counts)))
    return ids, meta


def test_advance_gives_each_sequence_the_metadata_of_where_it_stands():
    """Eager path: metadata built for rejected drafts, then moved on the device by the verdict's
    flags (``TokenFill.apply``, ``metadata.advance``), equals metadata built from where each
    sequence really stands, blocks crossed included; sequences without a row never move, and the
    host bounds cover both outcomes."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        batch, width, rows = int(torch.randint(1, 8, (1,), generator=gen)), 4, 5
        tables = torch.randperm(40, generator=gen)[: batch * width].view(batch, width).int()
        counts = torch.randint(1, 3, (batch,), generator=gen).tolist()
        starts = _starts(batch, width, gen)
        fill = _fill(batch, counts, gen, _verdict(rows, gen, torch.full((5 * rows,), -9)), rows)
        meta = BatchMetadata.for_step(starts, counts, tables, torch.arange(sum(counts))).with_room(
            [m >= 0 for m in fill.moves])
        host_ids = torch.randint(10, 1000, (sum(counts),), generator=gen)
        ids, moved = fill.apply(host_ids.clone())
        got = advance(meta, moved)
        want_ids, want = _expected(fill, starts, counts, tables, host_ids)
        assert torch.equal(ids, want_ids), trial
        for name in ("positions", "slot_mapping", "context_lens", "seq_ids", "block_tables"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (trial, name)
        assert all(b >= w for b, w in zip(meta.context_lens_host, want.context_lens_host))
        assert meta.max_context_len >= want.max_context_len


def test_decode_graph_moves_accepted_sequences_inside_the_graph(monkeypatch):
    """The CUDA-graph path (its static inputs and in-graph pick, replayed eagerly): the host stages
    only the step built for rejected drafts and the fill's indices; the graph's positions, slots,
    context lengths and input ids, written in place for the MTP layer's graph, equal those built
    from where each sequence stands, on random batches padded to their bucket with moves across
    block ends; padding rows write nothing. The verdict lies in the graphs' own source buffer (as
    the runner writes it) or, half the time, elsewhere (then the graph's copy of it is used)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # the CPU build cannot pin
    width, max_batch = 4, 8
    graphs = DecodeGraphs(None, SimpleNamespace(block_size=BLOCK_SIZE), max_batch, width * BLOCK_SIZE,
                          torch.device("cpu"), speculative=True)
    graphs._fill_padding(0, max_batch)
    seen = {}

    def replay(bucket):  # what the forward's graph gives the model, and leaves for the MTP layer's
        seen.update(meta=graphs._take_from_source(bucket), ids=graphs.input_ids(2 * bucket).clone(),
                    left=graphs._meta(bucket))

    for b in graphs.buckets:
        graphs.graphs[b] = SimpleNamespace(replay=lambda b=b: replay(b))
        graphs.outputs[b] = (torch.zeros(2 * b, 1), torch.zeros(2 * b, 1))
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        batch, rows = int(torch.randint(1, max_batch + 1, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        tables = torch.randperm(64, generator=gen)[: batch * width].view(batch, width).int()
        starts, counts = _starts(batch, width, gen), [2] * batch
        out = graphs.source if trial % 2 else torch.full((5 * max_batch,), -9)
        fill = _fill(batch, counts, gen, _verdict(rows, gen, out), rows)
        meta = BatchMetadata.for_step(starts, counts, tables, torch.arange(2 * batch))
        host_ids = torch.randint(10, 1000, (2 * batch,), generator=gen)
        graphs.inputs.fill_(-5)  # poison: the step's copy must rewrite everything the graph reads
        graphs.replay(host_ids, meta.with_room([m >= 0 for m in fill.moves]), fill)
        want_ids, want = _expected(fill, starts, counts, tables, host_ids)
        assert torch.equal(seen["ids"][: 2 * batch], want_ids), trial
        for got in (seen["meta"], seen["left"]):
            assert torch.equal(got.positions[: 2 * batch], want.positions), trial
            assert torch.equal(got.slot_mapping[: 2 * batch], want.slot_mapping), trial
            assert torch.equal(got.context_lens[:batch], want.context_lens), trial
            assert (got.slot_mapping[2 * batch :] == -1).all() and (got.positions[2 * batch :] < 2).all(), trial


def _with_eager_graphs(engine: LLMEngine, monkeypatch) -> DecodeGraphs:
    """Give ``engine``'s runner decode graphs whose "replay" runs the captured forward eagerly (the
    CPU has no CUDA graphs): their static inputs, staging, in-graph variant pick and greedy verdict
    run as on a GPU."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # the CPU build cannot pin
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.caches, engine.config.max_num_seqs, engine.max_model_len,
                          runner.device, speculative=runner.speculative)
    graphs._fill_padding(0, graphs.max_batch)
    graphs.inputs.copy_(graphs.staging)
    for b in graphs.buckets:
        graphs.graphs[b] = SimpleNamespace(replay=lambda b=b: graphs.outputs.__setitem__(b, graphs._forward(b)))
        graphs.draft_graphs[b] = SimpleNamespace(
            replay=lambda b=b: graphs.draft_outputs.__setitem__(b, graphs._draft_forward(b)))
        # captured under inference mode on a GPU, replayed outside it
        graphs.verdict_graphs[b] = SimpleNamespace(replay=torch.inference_mode()(lambda b=b: graphs._verdict_forward(b)))
    runner.graphs = graphs
    return graphs


def _count_replays(graphs: DecodeGraphs, monkeypatch) -> dict[str, list[bool]]:
    """Per replay method of ``graphs`` (forward, draft, greedy verdict): for each call, whether it
    took a fill with moves (a step behind a speculative one, both variants staged)."""
    calls = {name: [] for name in ("replay", "replay_draft", "replay_verdict")}
    for name, seen in calls.items():
        method = getattr(graphs, name)
        monkeypatch.setattr(graphs, name, lambda *a, method=method, seen=seen: seen.append(
            len(a) > 2 and a[2] is not None and a[2].moves is not None) or method(*a))
    return calls


def test_decode_graph_inputs_pick_each_sequences_variant(default_model, monkeypatch):
    """The CUDA-graph path's static buffer (both variants in one upload, the pick inside the
    graph, padding rows), replayed eagerly: the tokens of plain decoding, the synchronous counts.
    Overlapped greedy decode steps are one replay each of the verdict graph (forward, verification
    and next drafts), never of the forward or the draft graph; synchronous ones replay the forward
    and the draft graph."""
    requests = _requests(default_model[1])
    want = run_engine(_engine(default_model, "plain"), requests)
    counts, replays = {}, {}
    for setting in ("speculative", "speculative+async"):
        engine = _engine(default_model, setting)
        replays[setting] = _count_replays(_with_eager_graphs(engine, monkeypatch), monkeypatch)
        assert run_engine(engine, requests) == want, setting
        counts[setting] = (engine.num_draft_tokens, engine.num_accepted_tokens)
        assert engine.block_manager.num_used_blocks == 0
    assert counts["speculative+async"] == counts["speculative"]
    sync, overlapped = replays["speculative"], replays["speculative+async"]
    assert len(sync["replay"]) > 10 and len(sync["replay_draft"]) == len(sync["replay"]) and not sync["replay_verdict"]
    assert sum(overlapped["replay_verdict"]) > 10  # overlapped verdict replays with both variants
    assert len(overlapped["replay_draft"]) == len(overlapped["replay"]) < len(overlapped["replay_verdict"]) / 4


def test_decode_graphs_overlap_a_sampled_request_beside_greedy_ones(default_model, monkeypatch):
    """An unseeded sampled request among greedy ones, overlapped through the decode graphs (replayed
    eagerly): while it runs, steps replay the forward and the draft graph around the host-driven
    verification, after it the verdict graph alone; the greedy requests' tokens are plain
    decoding's and the sampled one ends at its max_tokens."""
    requests = _requests(default_model[1])
    sampled = (0, "sampled", requests[0][2][:50], SamplingParams(max_tokens=25, temperature=0.8, top_k=40,
                                                                 ignore_eos=True))
    want = run_engine(_engine(default_model, "plain"), requests)
    engine = _engine(default_model, "speculative+async")
    replays = _count_replays(_with_eager_graphs(engine, monkeypatch), monkeypatch)
    torch.manual_seed(0)  # the sampled request's draws (unseeded: the global generator), so its length in steps
    got = run_engine(engine, requests + [sampled])
    assert len(got.pop("sampled")["tokens"]) == 25 and got == want
    assert sum(replays["replay"]) > 5 and sum(replays["replay_verdict"]) > 0, replays
    assert len(replays["replay_draft"]) >= sum(replays["replay"])
    assert engine.block_manager.num_used_blocks == 0


def test_decode_graph_takes_a_plain_steps_sampled_tokens_from_its_source(default_model, monkeypatch):
    """Async plain decoding through the decode graphs (replayed eagerly): each overlapped step's
    sampled tokens are copied into the graphs' source and the graph fills its input ids from
    there; the tokens are those of synchronous plain decoding."""
    requests = _requests(default_model[1])
    want = run_engine(_engine(default_model, "plain"), requests)
    engine = _engine(default_model, "plain", async_scheduling=True)
    graphs = _with_eager_graphs(engine, monkeypatch)
    filled, replay = [], graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda *a: filled.append(len(a) > 2 and a[2] is not None) or replay(*a))
    assert run_engine(engine, requests) == want
    assert sum(filled) > 10 and engine.block_manager.num_used_blocks == 0
