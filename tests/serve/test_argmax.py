"""``argmax_rows`` against ``torch.argmax(dim=1)``: ties to the first index, NaN rows (the first
NaN wins, also over +inf), all -inf rows, widths off the chunk size, strided rows, every float
dtype. The CPU test runs the Triton kernels in a subprocess with TRITON_INTERPRET=1; the GPU test
adds vocabulary-wide rows (129280, V4's) in batches of 1..300 and a CUDA-graph replay."""

from __future__ import annotations

import sys

import pytest
import torch

from flashdsa.runtime.argmax import CHUNK, argmax_rows
from flashdsa.testing import poisoned_empty, run_under_interpreter

SEED = 7


def tricky_rows(width: int, device, dtype=torch.float32) -> torch.Tensor:
    """Random rows, then: a tie of the maximum in two chunks, a NaN after a +inf, two NaNs, all -inf."""
    g = torch.Generator().manual_seed(SEED + width)
    x = torch.randn(6, width, generator=g)
    near, far = min(width - 1, 3), min(width - 1, CHUNK + 5)
    x[1, [near, far]] = 100.0
    x[2, near // 2] = float("inf")
    x[2, far] = float("nan")
    x[3, [far, near]] = float("nan")
    x[4] = float("-inf")
    x[5, width - 1] = 50.0  # the maximum in the last (partial) chunk
    return x.to(device, dtype)


def check(x: torch.Tensor) -> None:
    got = argmax_rows(x)
    want = x.float().cpu().argmax(dim=1)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want), f"got {got.tolist()} want {want.tolist()}"


def run_interpreter_cases() -> None:
    with poisoned_empty():
        for width in (1, 5, CHUNK, CHUNK + 7, 3 * CHUNK - 1):
            check(tricky_rows(width, "cpu"))
        check(tricky_rows(CHUNK + 7, "cpu", torch.bfloat16))
        check(tricky_rows(2 * CHUNK + 40, "cpu")[:, 20:])  # strided rows
    print("interpreter cases passed")


def test_argmax_under_interpreter():
    run_under_interpreter(__file__, SEED)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="x must be float .N, V."):
        argmax_rows(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="x must be float .N, V."):
        argmax_rows(torch.zeros(2, 3, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_on_the_gpu(dtype):
    cuda = torch.device("cuda")
    for width in (1, 77, CHUNK, 129280):
        check(tricky_rows(width, cuda, dtype))
    g = torch.Generator(device=cuda).manual_seed(SEED)
    for rows in (1, 32, 300):
        x = torch.randn(rows, 129280, generator=g, device=cuda).to(dtype)
        check(x)
        check(x.round())  # many ties
    assert argmax_rows(torch.zeros(0, 129280, device=cuda)).shape == (0,)


@pytest.mark.gpu
def test_replays_in_a_cuda_graph():
    cuda = torch.device("cuda")
    x = torch.randn(4, 129280, device=cuda)
    argmax_rows(x)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = argmax_rows(x)
    x.copy_(tricky_rows(129280, cuda)[:4])
    graph.replay()
    assert torch.equal(got, x.argmax(dim=1))


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    torch.set_num_threads(2)
    run_interpreter_cases()
