"""DeepSeek-V4 through the engine: continuous batching, chunked prefill, preemption and state-slot
reuse give the tokens of the one-sequence reference path; what V4 does not support yet is refused."""

import pytest
import torch

from flashdsa.errors import ArgumentError
from flashdsa.models.deepseek_v4_loader import load_v4_model
from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams

PROMPT_LENGTHS = (1, 5, 120, 200, 60)  # the third and last cross a block boundary as they decode


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_v4_checkpoint(tmp_path_factory.mktemp("v4engine"), seed=4)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(checkpoint, prompts):
    model = load_v4_model(checkpoint)
    return [model.generate_greedy(torch.tensor(p), 24).tolist() for p in prompts]


@pytest.mark.parametrize("options", [
    dict(max_num_seqs=2, max_num_batched_tokens=48),  # queueing, chunked prefill, decode mixed in
    dict(max_num_seqs=4, max_num_batched_tokens=512, num_blocks=8),  # too few blocks: preemption
    dict(max_num_seqs=3, max_num_batched_tokens=64, async_scheduling=True),  # one step in flight
])
def test_greedy_tokens_equal_the_one_sequence_path(checkpoint, prompts, expected, options):
    llm = LLM(str(checkpoint), device="cpu", mode="reference", **options)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in results] == expected
    engine = llm.engine
    assert engine.block_manager.num_used_blocks == 0
    assert sorted(engine.block_manager.free_state_slots) == list(range(options["max_num_seqs"]))
    if "num_blocks" in options:
        assert engine.scheduler.num_preemptions > 0


def _greedy(llm, prompt, tokens=12):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("overlapped", [False, True])
def test_prefix_hits_restore_the_state_snapshot_and_give_the_same_tokens(checkpoint, prompts, overlapped):
    """A repeated prompt and a second turn resume from the first prompt's snapshot (its last full
    block); the tokens are the one-sequence path's, with async scheduling too."""
    reference = load_v4_model(checkpoint)
    llm = LLM(str(checkpoint), device="cpu", mode="reference", max_num_seqs=2, max_num_batched_tokens=96,
              async_scheduling=overlapped)
    engine, manager = llm.engine, llm.engine.block_manager
    first = prompts[3]  # 200 tokens: its snapshot covers 192
    want = reference.generate_greedy(torch.tensor(first), 12).tolist()
    assert _greedy(llm, first) == want and manager.snapshot_of
    hits = engine.scheduler.prefix_hits
    assert _greedy(llm, first) == want
    assert engine.scheduler.prefix_hits - hits == 192
    second_turn = first + want + prompts[1]
    hits = engine.scheduler.prefix_hits
    assert _greedy(llm, second_turn) == reference.generate_greedy(torch.tensor(second_turn), 12).tolist()
    assert engine.scheduler.prefix_hits - hits == 192  # the first turn's snapshot (the second's is at 192 too)
    assert manager.num_used_blocks == 0 and len(manager.free_state_slots) == 2
    assert len(manager.free_snapshot_slots) + len(manager.snapshot_of) == 2  # none leaked


def test_snapshots_are_evicted_least_recently_used(checkpoint, prompts):
    llm = LLM(str(checkpoint), device="cpu", mode="reference", max_num_seqs=1)  # one snapshot slot
    manager = llm.engine.block_manager
    a, b = prompts[2], prompts[3]
    first = _greedy(llm, a, 4)
    _greedy(llm, b, 4)  # takes the only snapshot slot: a's goes
    hits = llm.engine.scheduler.prefix_hits
    assert _greedy(llm, a, 4) == first and llm.engine.scheduler.prefix_hits == hits  # recomputed, same tokens
    assert len(manager.snapshot_of) == 1 and not manager.free_snapshot_slots


def test_production_mode_generates_on_the_cpu(checkpoint, prompts):
    llm = LLM(str(checkpoint), device="cpu", max_num_seqs=3, max_num_batched_tokens=100)
    results = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(r.outputs[0].token_ids) for r in results] == [8] * len(prompts)


def test_a_loaded_v4_model_refuses_speculative_decoding(checkpoint):
    from transformers import AutoTokenizer

    model = load_v4_model(checkpoint, mtp=True)
    with pytest.raises(ValueError, match="speculative_tokens"):
        LLM(model, AutoTokenizer.from_pretrained(str(checkpoint)), speculative_tokens=1)


@pytest.mark.parametrize("options, argument", [
    (dict(speculative_tokens=1), "speculative_tokens"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(quantization="fp8"), "quantization"),
])
def test_what_v4_does_not_do_yet_is_refused_by_name(checkpoint, options, argument):
    with pytest.raises(ArgumentError, match=argument):
        LLM(str(checkpoint), device="cpu", **options)


def test_the_server_serves_v4_completions_and_chat(checkpoint):
    import openai
    from server_thread import ServerThread, wait_until_idle
    from transformers import AutoTokenizer

    from flashdsa.runtime.engine import EngineConfig
    from flashdsa.serve.command import make_app

    model, tokenizer = load_v4_model(checkpoint), AutoTokenizer.from_pretrained(str(checkpoint))
    app = make_app(model, tokenizer, "v4", EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=16))
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        full = client.completions.create(model="v4", prompt="The quick brown fox " * 20, temperature=0, max_tokens=5)
        assert full.usage.completion_tokens == 5
        chunks = list(client.chat.completions.create(model="v4", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        wait_until_idle(server)
        manager = server.engine.block_manager
        assert manager.num_used_blocks == 0 and len(manager.free_state_slots) == 4
