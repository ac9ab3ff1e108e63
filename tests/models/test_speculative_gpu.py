"""GPU: speculative decoding with the MTP layer in production mode (FP8 caches), eager and as CUDA
graphs, synchronous and overlapped (async scheduling), gives the same greedy tokens as plain
decoding; an overlapped speculative decode step waits for the GPU once; the MTP forward makes no
host sync; the MTP layer passes `flashdsa check` in production mode."""

from dataclasses import replace

import pytest
import torch

from flashdsa.check.layerwise import THRESHOLDS
from flashdsa.check.mtp import compare_mtp, flashdsa_mtp, mtp_failures, reference_mtp
from flashdsa.models.batch import contiguous_block_tables, step_metadata
from flashdsa.models.loader import load_model
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.checks import trusted_values
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_greedy_tokens_are_identical_with_speculation_eager_and_graphed(tmp_path, fp8):
    path = make_tiny_checkpoint(tmp_path, fp8=fp8, mtp=True, seed=3)
    prompts = [list(range(4 + i, 40 + 7 * i)) for i in range(5)]  # 5 sequences: the bucket of 8 pads 3
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    tokens = {}
    for spec, eager, overlapped in ((0, False, False), (1, True, False), (1, False, False), (1, True, True),
                                    (1, False, True)):
        llm = LLM(path, device="cuda", max_num_seqs=8, max_model_len=512, enforce_eager=eager,
                  speculative_tokens=spec, async_scheduling=overlapped)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[spec, eager, overlapped] = [r.outputs[0].token_ids for r in outs]
        if spec:
            assert llm.engine.num_draft_tokens > 0 and llm.engine.block_manager.num_used_blocks == 0
            graphs = llm.engine.runner.graphs
            assert bool(graphs and graphs.draft_graphs and graphs.verdict_graphs) == (not eager)
    for key, found in tokens.items():
        assert found == tokens[0, False, False], key


def _default_model_requests(tokenizer, count: int, max_tokens: int):
    """``count`` Shakespeare-like prompts of different lengths for the default model, greedy."""
    text = ("ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the "
            "sun.\nJULIET:\nO Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name.\n")
    ids = tokenizer(text)["input_ids"]
    return [ids[: 12 + 9 * i] for i in range(count)], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      ignore_eos=True)


@pytest.mark.gpu
def test_overlapped_speculation_on_the_default_model_gives_the_synchronous_tokens():
    """The default model's trained MTP layer accepts about 2 drafts in 3, so both outcomes of a
    step in flight occur; CUDA graphs on both sides, 5 sequences of different lengths (the bucket
    of 8 pads 3), max_tokens of both parities."""
    from flashdsa.defaults import DEFAULT_MODEL

    results, counts = {}, {}
    for overlapped in (False, True):
        engine = LLM(DEFAULT_MODEL, device="cuda", max_num_seqs=8, max_model_len=512, speculative_tokens=1,
                     async_scheduling=overlapped).engine
        prompts, params = _default_model_requests(engine.tokenizer, 5, 1)  # max_tokens set per request below
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, replace(params, max_tokens=60 + i))
        results[overlapped] = [[] for _ in prompts]
        while engine.has_unfinished():
            for out in engine.step():
                results[overlapped][int(out.request_id)] += out.new_token_ids
        counts[overlapped] = (engine.num_draft_tokens, engine.num_accepted_tokens)
        assert engine.runner.graphs is not None and engine.block_manager.num_used_blocks == 0
    assert results[True] == results[False] and counts[True] == counts[False]
    assert [len(t) for t in results[True]] == [60 + i for i in range(5)]
    assert counts[True][1] > counts[True][0] / 3


@pytest.mark.gpu
def test_an_overlapped_speculative_decode_step_waits_for_the_gpu_once(steps_without_syncs):
    """Exactly one wait (for the tokens and drafts of the step before) and one graph replay (the
    model at s_q = 2, the greedy verification and the MTP layer's drafts in one graph) per step,
    both outcomes of drafts occurring."""
    from flashdsa.defaults import DEFAULT_MODEL

    engine = LLM(DEFAULT_MODEL, device="cuda", max_num_seqs=8, max_model_len=512, speculative_tokens=1,
                 async_scheduling=True).engine
    prompts, params = _default_model_requests(engine.tokenizer, 5, 200)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    for _ in range(4):  # the prefill (synchronous with speculation) and the first overlapped steps
        engine.step()
    outputs, waits, replays = steps_without_syncs(engine, 10)
    assert waits == 10 and replays == ["replay_verdict"] * 10
    assert all(len(step) == 5 and all(len(o.new_token_ids) in (1, 2) for o in step) for step in outputs)
    assert any(len(o.new_token_ids) == 2 for step in outputs for o in step)  # accepted drafts ran behind


@pytest.mark.gpu
def test_mtp_forward_makes_no_host_sync(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path, mtp=True), device="cuda", mtp=True)
    caches = model.allocate_caches(8)
    tables = contiguous_block_tables([100, 100])
    ids = torch.randint(4, 500, (2, 80), device="cuda")
    with trusted_values():
        model(ids.flatten(), step_metadata([0, 0], [80, 80], tables, device="cuda"), caches)
        step = step_metadata([79, 79], [2, 2], tables, all_logits=True, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _, hidden = model(ids[:, -2:].flatten(), step, caches, return_hidden=True)
            logits = model.mtp_forward(ids[:, -2:].flatten(), hidden, step, caches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (4, model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.gpu
def test_mtp_passes_the_production_check(tmp_path):
    path = make_tiny_checkpoint(tmp_path, mtp=True, seed=4)
    ids = torch.randint(4, 500, (200,), generator=torch.Generator().manual_seed(0)).cuda()
    result = compare_mtp(reference_mtp(path, ids, "cuda"), flashdsa_mtp(load_model(path, "cuda", mtp=True), ids))
    assert mtp_failures(result, THRESHOLDS["production"]) == [], result
