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


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_two_ranks_give_the_single_process_greedy_tokens(checkpoint, single, expert_parallel, async_scheduling):
    """Async: the steps' last input ids reach the worker in the device-group broadcast behind each
    step message (``parallel.steps.send_step``), not in the message."""
    llm = LLM(checkpoint, mode="reference", max_num_seqs=2, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel, async_scheduling=async_scheduling)
    assert llm.engine.runner.model.shard.size == 2
    assert _greedy(llm) == single


def test_a_second_engine_on_a_parallel_model_rebuilds_the_workers_runner(checkpoint, single):
    """A new engine on the same model (as a benchmark sweeping batch sizes builds) sends the
    workers a new RunnerSpec mid-stream; they replace their caches and follow it."""
    first = LLM(checkpoint, mode="reference", max_num_seqs=2, tensor_parallel_size=2)
    first.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    second = LLM(first.engine.runner.model, first.tokenizer, max_num_seqs=3, num_blocks=12)
    assert _greedy(second) == single


@pytest.mark.gpu
def test_async_scheduling_on_two_gpus_gives_the_synchronous_tokens(checkpoint):
    """Production mode (FP8 caches, CUDA graphs, NCCL): the overlapped steps, whose last input ids
    reach rank 1 in an NCCL broadcast, give the synchronous steps' greedy tokens."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    llm = LLM(checkpoint, max_num_seqs=4, tensor_parallel_size=2, enforce_eager=False)
    try:
        assert llm.engine.runner.graphs is not None
        tokens = {}
        for overlapped in (True, False):
            llm.engine.async_scheduling = overlapped
            tokens[overlapped] = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert tokens[True] == tokens[False]
    finally:
        llm.close()


def test_a_worker_logs_the_median_host_time_of_its_graph_steps(caplog):
    from collections import deque

    from flashdsa.runtime.parallel.steps import _log_step_times

    with caplog.at_level("INFO", logger="flashdsa.runtime.parallel.steps"):
        _log_step_times(1, deque(), deque())
        assert not caplog.records  # a runner that replayed no graph logs nothing
        _log_step_times(1, deque([0.001, 0.003, 0.002]), deque([0.0005, 0.0004, 0.0006]))
    assert caplog.messages == ["rank 1: 3 graph steps, host ms a step (median): 2.000 waiting for rank 0, "
                               "0.500 queueing it"]
