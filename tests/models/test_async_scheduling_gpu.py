"""GPU: async scheduling (runtime/overlap.py) with CUDA graphs gives the synchronous engine's
tokens, and its decode loop waits for the GPU only to read back the previous step's tokens."""

from dataclasses import replace

import pytest

from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams


def _requests():
    """5 sequences (the bucket of 8 pads 3): greedy, seeded sampling with logprobs, a stop id."""
    prompts = [list(range(4 + i, 40 + 7 * i)) for i in range(5)]
    params = [SamplingParams(max_tokens=40 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=7, ignore_eos=True, logprobs=2),
               SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[17, 23, 300])]
    return prompts, params


def _run(llm: LLM, prompts, params) -> dict:
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    got = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs = out.new_logprobs or [None] * len(out.new_token_ids)
            got[out.request_id] += [(t, lp and round(lp.logprob, 3)) for t, lp in zip(out.new_token_ids, logprobs)]
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_overlapped_decoding_gives_the_synchronous_tokens_with_cuda_graphs(tmp_path, fp8):
    path = make_tiny_checkpoint(tmp_path, fp8=fp8)
    prompts, params = _requests()
    results = {}
    for overlapped in (False, True):
        llm = LLM(path, device="cuda", max_num_seqs=8, max_model_len=512, async_scheduling=overlapped)
        assert llm.engine.runner.graphs is not None and llm.engine.async_scheduling == overlapped
        results[overlapped] = _run(llm, prompts, params)
        assert llm.engine.block_manager.num_used_blocks == 0
    assert results[True] == results[False]
    assert LLM(path, device="cuda", max_num_seqs=2, max_model_len=256).engine.async_scheduling  # the CUDA default


@pytest.mark.gpu
def test_the_decode_loop_waits_only_for_the_previous_steps_tokens(tmp_path, steps_without_syncs):
    """Exactly one wait (for the tokens of the step before) and one graph replay per step."""
    llm = LLM(make_tiny_checkpoint(tmp_path), device="cuda", max_num_seqs=8, max_model_len=512, async_scheduling=True)
    engine = llm.engine
    prompts, params = _requests()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, replace(p, stop_token_ids=[], max_tokens=100))  # all 10 steps decode
    for _ in range(4):  # the prefill and the first overlapped decode steps, syncs allowed
        engine.step()
    outputs, waits, replays = steps_without_syncs(engine, 10)
    assert waits == 10 and replays == ["replay"] * 10
    assert all(len(step) == 5 and all(len(o.new_token_ids) == 1 for o in step) for step in outputs)
