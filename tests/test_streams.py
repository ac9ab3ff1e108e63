"""Side-stream branches (``runtime.streams``): in line outside a CUDA graph capture, a parallel
branch of the graph inside one, with the same results either way."""

from __future__ import annotations

import pytest
import torch

from flashdsa.runtime.gemm.triton import gemm as triton_gemm
from flashdsa.runtime.streams import branch, on_side_stream


def test_outside_a_capture_the_branch_runs_in_line():
    x = torch.ones(4)
    side = branch(x)
    with side.run():
        y = x * 2
    side.join()
    assert side.side is None and not side.forked and torch.equal(y, torch.full((4,), 2.0))


def test_a_lane_out_of_range_is_refused():
    with pytest.raises(ValueError, match="lane must be in"):
        branch(torch.ones(1), 3)


@pytest.mark.gpu
def test_a_captured_branch_runs_on_the_side_stream_and_replays_what_eager_computes():
    device = torch.device("cuda")
    x = torch.randn(64, 256, device=device)
    w = torch.randn(256, 256, device=device)

    def step(seen: list[bool]) -> torch.Tensor:
        side = branch(x)
        with side.run():
            seen.append(on_side_stream(device))
            beside = torch.relu(x @ w)
        main = torch.tanh(x @ w.T)
        side.join()
        return main + beside

    eager_seen: list[bool] = []
    eager = step(eager_seen)
    torch.cuda.synchronize()
    graph, captured_seen = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        out = step(captured_seen)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert eager_seen == [False] and captured_seen == [True]
    torch.testing.assert_close(out, step([]), rtol=0, atol=0)  # the replay computed the eager function
    assert not torch.equal(out, eager)  # the replay read the new x


@pytest.mark.gpu
def test_the_side_stream_gets_no_split_k_ticket_counters():
    """fp8_linear's ticket counters are one buffer a device: a branch beside the main stream's
    GEMMs must sum its splits in a second kernel instead."""
    device = torch.device("cuda")
    assert triton_gemm._counters_for(device, 1) is not None  # main stream, outside a capture: made
    graph, seen = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        side = branch(torch.empty(1, device=device))
        with side.run():
            seen.append(triton_gemm._counters_for(device, 1))
        side.join()
    assert seen == [None]


@pytest.mark.gpu
def test_a_branch_that_joins_another_reads_its_result_in_the_replay():
    """Branch b waits for branch a inside its own body (V4's indexer queries wait for its keys)."""
    device = torch.device("cuda")
    x = torch.randn(512, 512, device=device)

    def step() -> torch.Tensor:
        a, b = branch(x, 0), branch(x, 1)
        with a.run():
            from_a = (x @ x).relu()
        with b.run():
            from_b = x.tanh()
            a.join()
            from_b = from_b + from_a @ x
        main = x * 2
        a.join()
        b.join()
        return main + from_b

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, step(), rtol=0, atol=0)
