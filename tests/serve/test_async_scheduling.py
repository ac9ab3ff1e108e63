"""Async scheduling (runtime/overlap.py) on the CPU: the overlapped engine launches step n+1
before it reads step n's tokens, fills the ids it lacks from the sampled tokens, drops the wasted
token of a sequence that finished, and must give the synchronous engine's requests token for
token, with no block left behind."""

import pytest
from fake_model import POISON, FailsOnPoison, FakeModel, reference_greedy

from flashdsa.runtime import engine as engine_module
from flashdsa.runtime.engine import EngineConfig, LLMEngine
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.scheduler import Scheduler
from flashdsa.runtime.structured import StructuredOutputsParams

def workload(tok):
    """(arrival step, request id, prompt, params): greedy and seeded sampling, logprobs, stop
    strings and ids, max_tokens, min_tokens, logit bias, n > 1 seeds, and the cases that run
    synchronously (penalties, prompt logprobs, a grammar, a prompt-only request); long prompts
    with a shared prefix, so that chunked prefill, prefix hits and preemption all happen."""
    vocab = len(tok)
    head = [(7 * i) % 250 + 2 for i in range(130)]
    prompt = lambda i, n: head + [(i * 13 + j) % 250 + 2 for j in range(n)]  # noqa: E731
    greedy = dict(temperature=0, ignore_eos=True)
    text = tok.decode(reference_greedy(prompt(2, 9), vocab, 30, eos=-1), skip_special_tokens=True)
    stop_id = reference_greedy(prompt(3, 14), vocab, 30, eos=-1)[7]
    return [
        (0, "greedy", prompt(0, 5), SamplingParams(max_tokens=40, **greedy)),
        (0, "seeded", prompt(1, 30), SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=5, max_tokens=33,
                                                    ignore_eos=True, logprobs=3)),
        (0, "stop-text", prompt(2, 9), SamplingParams(stop=[text[12:15]], max_tokens=30, **greedy)),
        (1, "stop-id", prompt(3, 14), SamplingParams(stop_token_ids=[stop_id], max_tokens=30, **greedy)),
        (1, "eos", [5, 6, 7], SamplingParams(temperature=1.0, seed=11, max_tokens=60)),
        (2, "min-tokens", prompt(4, 3), SamplingParams(stop_token_ids=[stop_id], min_tokens=9, max_tokens=20, **greedy)),
        (2, "bias", prompt(5, 20), SamplingParams(logit_bias={17: 6.0, 3: -100.0}, max_tokens=25, logprobs=1, **greedy)),
        (3, "choice-0", prompt(6, 4), SamplingParams(temperature=1.0, seed=9, max_tokens=24, ignore_eos=True)),
        (3, "choice-1", prompt(6, 4), SamplingParams(temperature=1.0, seed=10, max_tokens=24, ignore_eos=True)),
        (5, "penalty", prompt(7, 8), SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=20,
                                                    **greedy)),
        (6, "prompt-logprobs", prompt(8, 40), SamplingParams(prompt_logprobs=2, max_tokens=6, **greedy)),
        (7, "grammar", [5, 6], SamplingParams(temperature=0, max_tokens=12,
                                              structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))),
        (8, "prompt-only", prompt(9, 2), SamplingParams(max_tokens=0, prompt_logprobs=0)),
        (9, "late", prompt(10, 1), SamplingParams(max_tokens=1, **greedy)),
        (12, "late-long", prompt(11, 70), SamplingParams(max_tokens=15, **greedy)),
    ]


def run_engine(engine: LLMEngine, requests, abort_at: dict[str, int] = {}) -> dict:
    """Step ``engine`` through ``requests`` (added at their arrival step), aborting ``abort_at``'s
    requests at their step; each request's tokens, text, logprobs, prompt logprobs and ending."""
    results = {rid: dict(tokens=[], text="", logprobs=[], prompt=None, end=None) for _, rid, _, _ in requests}
    step = 0
    while step < 20 or engine.has_unfinished():
        for _, rid, prompt, params in [r for r in requests if r[0] == step]:
            engine.add_request(rid, prompt, params)
        for rid in [rid for rid, at in abort_at.items() if at == step]:
            engine.abort(rid)
        for out in engine.step():
            r = results[out.request_id]
            r["tokens"] += out.new_token_ids
            r["text"] += out.new_text
            r["logprobs"] += [(lp.token_id, round(lp.logprob, 4), sorted(lp.top)) for lp in out.new_logprobs]
            if out.prompt_logprobs is not None:
                r["prompt"] = [None if lp is None else (lp.token_id, round(lp.logprob, 4)) for lp in out.prompt_logprobs]
            if out.finished:
                r["end"] = (out.finish_reason, out.stop_reason, out.error)
        step += 1
        assert step < 500, "the engine does not finish"
    return results


def make(tok, model=None, **options) -> LLMEngine:
    config = EngineConfig(num_blocks=7, max_num_seqs=6, max_num_batched_tokens=96, **options)
    return LLMEngine(model or FakeModel(len(tok)), tok, config)


@pytest.fixture
def probes(monkeypatch):
    """Counts of the overlapped path's events: launches, device-filled ids, dropped tokens."""
    counts = dict(launches=0, fills=0, dropped=0)
    launch, complete, fill = LLMEngine._launch, LLMEngine._complete, engine_module.token_fill

    def counting_launch(self, chunks, previous):
        in_flight = launch(self, chunks, previous)
        counts["launches"] += in_flight is not None
        return in_flight

    def counting_complete(self, step):
        counts["dropped"] += sum(c.seq.is_finished for c in step.chunks)
        return complete(self, step)

    def counting_fill(chunks, previous):
        found = fill(chunks, previous)
        counts["fills"] += 0 if found is None else sum(i >= 0 for i in found.ids)
        return found

    monkeypatch.setattr(LLMEngine, "_launch", counting_launch)
    monkeypatch.setattr(LLMEngine, "_complete", counting_complete)
    monkeypatch.setattr(engine_module, "token_fill", counting_fill)
    return counts


def test_overlapped_engine_gives_the_synchronous_engines_outputs(tok, probes):
    requests = workload(tok)
    sync_engine = make(tok, async_scheduling=False)
    want = run_engine(sync_engine, requests)
    assert probes["launches"] == 0
    engine = make(tok, async_scheduling=True)
    got = run_engine(engine, requests)
    for rid, expected in want.items():
        assert got[rid] == expected, rid
    assert want["stop-text"]["end"][0] == want["stop-id"]["end"][0] == "stop"
    assert want["grammar"]["text"] in ("yes", "no") and want["prompt-only"]["tokens"] == []
    assert len(want["prompt-logprobs"]["prompt"]) == len(requests[10][2])
    # the overlapped path ran, filled ids on the device and dropped wasted tokens; so did the fallbacks
    assert probes["launches"] > 20 and probes["fills"] > 20 and probes["dropped"] > 0
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_hits > 0, vars(engine.scheduler)
    for e in (sync_engine, engine):
        assert e.block_manager.num_used_blocks == 0 and not e.scheduler.running and not e.scheduler.waiting


def test_preempting_a_sequence_whose_token_is_in_flight_keeps_its_tokens(tok, monkeypatch):
    """Decodes that outgrow the cache: the newest sequence is preempted while its latest token is
    still on the device; it gets that token, recomputes, and ends as the synchronous engine's."""
    vocab, in_flight = len(tok), []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq: in_flight.append(seq.num_pending_tokens) or
                        preempt(self, seq))
    requests = []
    for i in range(5):
        prompt = [(i * 31 + j) % 250 + 2 for j in range(50 + 5 * i)]
        stop = reference_greedy(prompt, vocab, 90, eos=-1)[60 + 3 * i]
        requests.append((0, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=90, ignore_eos=True,
                                                            stop_token_ids=[stop])))
    options = dict(num_blocks=5, max_num_seqs=5)
    want = run_engine(LLMEngine(FakeModel(vocab), tok, EngineConfig(async_scheduling=False, **options)), requests)
    in_flight.clear()
    engine = LLMEngine(FakeModel(vocab), tok, EngineConfig(async_scheduling=True, **options))
    assert run_engine(engine, requests) == want
    assert any(in_flight) and engine.block_manager.num_used_blocks == 0


def test_aborts_mid_stream_free_everything_and_leave_the_others_alone(tok):
    requests = workload(tok)[:9]
    want = run_engine(make(tok, async_scheduling=False), requests)
    engine = make(tok, async_scheduling=True)
    got = run_engine(engine, requests, abort_at={"greedy": 6, "seeded": 9, "choice-0": 5})
    for rid in ("greedy", "seeded", "choice-0"):
        assert got[rid]["end"] is None and got[rid]["tokens"] == want[rid]["tokens"][: len(got[rid]["tokens"])]
    for rid in set(want) - {"greedy", "seeded", "choice-0"}:
        assert got[rid] == want[rid], rid
    assert engine.num_aborted == 3 and engine.block_manager.num_used_blocks == 0


def test_a_failing_forward_fails_only_its_request(tok):
    """A request samples POISON, so the overlapped forward that takes it as input (filled on the
    device) fails: the step runs again synchronously, one request at a time, and only it fails."""
    requests = [(0, "ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
                (0, "bad", [8, 9], SamplingParams(temperature=0, max_tokens=12, logit_bias={POISON: 100})),
                (2, "later", [10, 11, 12], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    want = run_engine(make(tok, FailsOnPoison(len(tok)), async_scheduling=False), requests)
    engine = make(tok, FailsOnPoison(len(tok)), async_scheduling=True)
    got = run_engine(engine, requests)
    assert got == want
    assert got["bad"]["tokens"] == [POISON] and "poisoned input" in got["bad"]["end"][2]
    assert got["ok"]["end"] == ("length", None, None) and got["later"]["end"] == ("length", None, None)
    assert engine.num_failed == 1 and engine.block_manager.num_used_blocks == 0


def test_async_scheduling_defaults_to_cuda_only_and_reaches_the_llm_api(tok):
    assert make(tok).async_scheduling is False  # the CPU default
    llm = LLM(FakeModel(len(tok)), tok, num_blocks=16, async_scheduling=True)
    assert llm.engine.async_scheduling is True
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    out = llm.generate([[5, 6, 7], [9, 9]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [reference_greedy(p, len(tok), 20, eos=-1) for p in ([5, 6, 7], [9, 9])]


def test_the_tiny_model_decodes_the_same_overlapped(tiny):
    model, tokenizer = tiny
    prompts = [[(11 * i + 3 * j) % 300 + 4 for j in range(20 + 37 * i)] for i in range(4)]
    requests = [(i, f"p{i}", p, SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=12 + 3 * i,
                                               ignore_eos=True, logprobs=2 if i == 1 else None))
                for i, p in enumerate(prompts)]
    outputs = {}
    for overlapped in (False, True):
        engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=48,
                                                          async_scheduling=overlapped))
        outputs[overlapped] = run_engine(engine, requests)
        assert engine.block_manager.num_used_blocks == 0
    assert outputs[True] == outputs[False]
