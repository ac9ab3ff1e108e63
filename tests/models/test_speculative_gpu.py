"""GPU: speculative decoding with the MTP layer in production mode (FP8 caches), eager and as CUDA
graphs, gives the same greedy tokens as plain decoding; the MTP forward makes no host sync; the
MTP layer passes `flashdsa check` in production mode."""

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
    for spec, eager in ((0, False), (1, True), (1, False)):
        llm = LLM(path, device="cuda", max_num_seqs=8, max_model_len=512, enforce_eager=eager,
                  speculative_tokens=spec)
        tokens[spec, eager] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        if spec:
            assert llm.engine.num_draft_tokens > 0 and llm.engine.block_manager.num_used_blocks == 0
            assert bool(llm.engine.runner.graphs and llm.engine.runner.graphs.draft_graphs) == (not eager)
    assert tokens[1, True] == tokens[0, False]
    assert tokens[1, False] == tokens[0, False]


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
