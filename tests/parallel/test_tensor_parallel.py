"""Tensor and expert parallelism over gloo on CPU: 2 ranks (this process and one spawned worker)
give the same greedy tokens as one process on the reference-mode tiny checkpoint."""

import pytest

from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


def _greedy(llm: LLM) -> list[list[int]]:
    try:
        return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def single(checkpoint):
    return _greedy(LLM(checkpoint, mode="reference", max_num_seqs=2))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_two_ranks_give_the_single_process_greedy_tokens(checkpoint, single, expert_parallel):
    llm = LLM(checkpoint, mode="reference", max_num_seqs=2, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel)
    assert llm.engine.runner.model.shard.size == 2
    assert _greedy(llm) == single


def test_a_second_engine_on_a_parallel_model_rebuilds_the_workers_runner(checkpoint, single):
    """A new engine on the same model (as a benchmark sweeping batch sizes builds) sends the
    workers a new RunnerSpec mid-stream; they replace their caches and follow it."""
    first = LLM(checkpoint, mode="reference", max_num_seqs=2, tensor_parallel_size=2)
    first.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    second = LLM(first.engine.runner.model, first.tokenizer, max_num_seqs=3, num_blocks=12)
    assert _greedy(second) == single
