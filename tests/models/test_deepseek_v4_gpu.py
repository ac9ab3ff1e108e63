"""GPU: DeepSeek-V4 in production mode (Triton kernels, FP8 MODEL1 caches) passes check, and its
decode step is sync-free and replays as a CUDA graph with the eager step's logits and cache writes
(what ``supports_cuda_graphs = True`` rests on; passed on an H100 in session 5), with bf16 weights and
with the release's FP8 linears and FP4 experts."""

import copy

import pytest
import torch

from flashdsa.cli import main
from flashdsa.models.deepseek_v4_loader import load_v4_model
from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint
from flashdsa.runtime.checks import trusted_values
from flashdsa.runtime.cuda_graphs import DecodeGraphs
from flashdsa.runtime.metadata import BatchMetadata

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["bf16", "release"])
def checkpoint(tmp_path_factory, request):
    """bf16 weights, or the release's formats kept in production mode (FP8 linears: the Triton FP8
    GEMM; FP4 experts: fused_moe's FP4 path)."""
    release = request.param == "release"
    return make_tiny_v4_checkpoint(tmp_path_factory.mktemp("v4gpu"), seed=6, fp8=release, fp4_experts=release)


def test_production_mode_passes_check_on_the_gpu(checkpoint, capsys):
    assert main(["check", "--model", str(checkpoint), "--mode", "production", "--device", "cuda", "--tokens", "300"]) == 0
    assert "PASS (production" in capsys.readouterr().out


def _step(starts: list[int], counts: list[int], slots: list[int]) -> BatchMetadata:
    tables = torch.tensor([[1 + 8 * b + i for i in range(8)] for b in range(len(starts))])  # block 0 left to padding
    rows = torch.tensor(counts).cumsum(0) - 1
    return BatchMetadata.for_step(starts, counts, tables, rows, state_slots=slots).to(torch.device("cuda"))


def test_decode_step_is_sync_free_and_replays_as_a_graph(checkpoint):
    model = load_v4_model(checkpoint, "cuda", mode="production")
    caches = model.allocate_caches(24, 3)
    prompt = torch.randint(2, 500, (2, 260), device="cuda")
    with trusted_values():
        model(prompt.flatten(), _step([0, 0], [260, 260], [1, 0]), caches)
        ids, decode = prompt[:, -1].contiguous(), _step([260, 260], [1, 1], [1, 0])
        graph_caches = copy.deepcopy(caches)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = model(ids, decode, caches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    graphs = DecodeGraphs(model, graph_caches, 2, 512, torch.device("cuda"))
    graphs.capture()
    replayed = graphs.replay(ids.cpu(), _step([260, 260], [1, 1], [1, 0]).to(torch.device("cpu")))
    torch.testing.assert_close(replayed, eager, rtol=1e-3, atol=1e-3)
    for ours, theirs in zip(graph_caches.layers, caches.layers):
        torch.testing.assert_close(ours.window[:2], theirs.window[:2])
        if ours.state is not None:
            torch.testing.assert_close(ours.state[0][:2], theirs.state[0][:2])
