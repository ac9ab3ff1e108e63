"""GPU: decode steps are sync-free and replay as CUDA graphs with the same greedy tokens as eager."""

import pytest
import torch

from flashdsa.models.batch import contiguous_block_tables, step_metadata
from flashdsa.models.loader import load_model
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.checks import trusted_values
from flashdsa.runtime.cuda_graphs import batch_buckets
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams


def test_batch_buckets_cover_every_size_once():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decode_forward_makes_no_host_sync(tmp_path, fp8):
    model = load_model(make_tiny_checkpoint(tmp_path, fp8=fp8), device="cuda")
    caches = model.allocate_caches(8)
    tables = contiguous_block_tables([100, 100, 100])
    ids = torch.randint(4, 500, (3, 80), device="cuda")
    with trusted_values():
        prefill = step_metadata([0, 0, 0], [80, 80, 80], tables, device="cuda")
        model(ids.flatten(), prefill, caches)
        decode = step_metadata([80, 80, 80], [1, 1, 1], tables, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = model(ids[:, -1], decode, caches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (3, model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_greedy_tokens_are_identical_with_and_without_cuda_graphs(tmp_path, fp8):
    path = make_tiny_checkpoint(tmp_path, fp8=fp8)
    prompts = [list(range(4 + i, 40 + 7 * i)) for i in range(5)]  # 5 sequences: the bucket of 8 pads 3 rows
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(path, device="cuda", max_num_seqs=8, max_model_len=512, enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        tokens[eager] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[False] == tokens[True]
