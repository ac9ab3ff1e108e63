"""Engine over a fake model that reads its context back from its paged cache: the text must not
depend on batching, chunking, preemption or prefix-cache hits."""

import pytest
import torch
from fake_model import FakeModel, context_logits, reference_greedy

from flashdsa.runtime.engine import EngineConfig, LLMEngine
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams


def prompts_with_shared_prefix(n):
    head = [(7 * i) % 250 + 2 for i in range(130)]  # two full blocks shared by everyone
    return [head + [(i * 13 + j) % 250 + 2 for j in range(5 + 9 * i)] for i in range(n)]


def test_greedy_text_survives_chunking_preemption_and_prefix_hits(tok):
    vocab = len(tok)
    llm = LLM(FakeModel(vocab), tok, num_blocks=10, max_num_seqs=6, max_num_batched_tokens=96)
    prompts = prompts_with_shared_prefix(8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.prefix_hits >= 2 * 64 * 4
    for prompt, result in zip(prompts, results):
        want = reference_greedy(prompt, vocab, 40, eos=-1)
        assert result.outputs[0].token_ids == want
        assert result.outputs[0].text == tok.decode(want, skip_special_tokens=True)
        assert result.outputs[0].finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0


def test_stop_conditions(tok):
    vocab = len(tok)
    llm = LLM(FakeModel(vocab), tok, num_blocks=32)
    prompt = [5, 6, 7]
    want = reference_greedy(prompt, vocab, 30, eos=-1)
    greedy = dict(temperature=0, max_tokens=30, ignore_eos=True)
    by_id = llm.generate([prompt], SamplingParams(stop_token_ids=[want[4]], **greedy), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == want[: want.index(want[4]) + 1] and by_id.stop_reason == want[4]
    full_text = tok.decode(want, skip_special_tokens=True)
    stop = full_text[10:13]
    by_text = llm.generate([prompt], SamplingParams(stop=[stop], **greedy), use_tqdm=False)[0].outputs[0]
    assert by_text.text == full_text[: full_text.index(stop)] and by_text.finish_reason == "stop"
    eos_model = LLM(FakeModel(vocab), tok, num_blocks=32)
    eos = tok.eos_token_id
    out = eos_model.generate([prompt], SamplingParams(stop_token_ids=[], temperature=0, max_tokens=30), use_tqdm=False)
    assert eos not in out[0].outputs[0].token_ids[:-1]


def test_seeded_sampling_repeats_and_choices_differ(tok):
    llm = LLM(FakeModel(len(tok)), tok, num_blocks=32)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=123, n=2, max_tokens=12, ignore_eos=True)
    first = llm.generate([[3, 4, 5]], params, use_tqdm=False)[0]
    other_batch = llm.generate([[9, 9], [3, 4, 5]], params, use_tqdm=False)[1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in other_batch.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids


def test_prompt_logprobs_cover_every_prompt_token_across_chunks(tok):
    vocab = len(tok)
    llm = LLM(FakeModel(vocab), tok, num_blocks=32, max_num_batched_tokens=50)
    prompt = [(i * 11) % 200 + 2 for i in range(120)]
    result = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    want = context_logits(torch.tensor(prompt[:60]), vocab).log_softmax(0)[prompt[60]]
    assert abs(result.prompt_logprobs[60].logprob - want.item()) < 1e-5


def test_abort_and_a_failing_forward_free_blocks_and_keep_the_engine(tok):
    class Flaky(FakeModel):
        def forward(self, input_ids, meta, caches):
            if (input_ids == 99).any():
                raise RuntimeError("boom")
            return super().forward(input_ids, meta, caches)

    engine = LLMEngine(Flaky(len(tok)), tok, EngineConfig(num_blocks=16))
    engine.add_request("bad", [99, 5], SamplingParams(max_tokens=5))
    outs = engine.step()
    assert outs[0].finish_reason == "error" and "boom" in outs[0].error
    engine.add_request("gone", [5] * 100, SamplingParams(max_tokens=50))
    engine.step()
    engine.abort("gone")
    engine.add_request("ok", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    done = []
    for _ in range(10):
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"] and done[0].num_output_tokens == 3
    assert engine.block_manager.num_used_blocks == 0


def test_requests_that_cannot_fit_are_refused(tok):
    engine = LLMEngine(FakeModel(len(tok), max_position_embeddings=100), tok, EngineConfig(num_blocks=8))
    with pytest.raises(ValueError, match="maximum context length is 100"):
        engine.add_request("a", [5] * 90, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("b", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("c", [10**6], SamplingParams())


@pytest.mark.parametrize("bad", [dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(num_blocks=0),
                                 dict(cache_fraction=1.5), dict(max_model_len=1)])
def test_engine_options_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig(**bad)


def test_a_prompt_only_request_scores_the_prompt_and_generates_nothing(tok):
    vocab = len(tok)
    llm = LLM(FakeModel(vocab), tok, num_blocks=16, max_model_len=64)
    prompt = [(i * 7) % 200 + 2 for i in range(64)]  # as long as the model allows: nothing left to generate
    result = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert result.outputs[0].token_ids == [] and result.outputs[0].finish_reason == "length"
    want = context_logits(torch.tensor(prompt[:10]), vocab).log_softmax(0)[prompt[10]]
    assert len(result.prompt_logprobs) == 64 and abs(result.prompt_logprobs[10].logprob - want.item()) < 1e-5
    assert llm.engine.block_manager.num_used_blocks == 0


def test_min_tokens_holds_off_every_stop_condition(tok):
    vocab = len(tok)
    llm = LLM(FakeModel(vocab), tok, num_blocks=32)
    prompt = [5, 6, 7]
    want = reference_greedy(prompt, vocab, 12, eos=-1)
    text = tok.decode(want, skip_special_tokens=True)
    early_stop = tok.decode(want[:2], skip_special_tokens=True)[-1]  # a character of the first tokens
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=6)
    by_text = llm.generate([prompt], SamplingParams(stop=[early_stop], **params), use_tqdm=False)[0].outputs[0]
    assert len(by_text.token_ids) >= 6 and by_text.token_ids == want[: len(by_text.token_ids)]
    assert by_text.text == text[: len(by_text.text)] and early_stop not in by_text.text[len(tok.decode(want[:6])):]
    by_id = llm.generate([prompt], SamplingParams(stop_token_ids=[want[1]], **params), use_tqdm=False)[0].outputs[0]
    assert want[1] not in by_id.token_ids[:6]  # masked until min_tokens: the text differs from greedy there
