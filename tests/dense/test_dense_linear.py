"""dense_linear: the Triton GEMV (interpreter on CPU, GPU) against an fp64 product; dispatch and
checks. Fresh random inputs each run, outputs poisoned before the kernel writes them."""

import os

import pytest
import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.dense import MAX_ROWS, dense_linear
from flashdsa.testing import kernel_test_main, poisoned_empty, run_under_interpreter

SEED = int.from_bytes(os.urandom(4), "little")

# (rows, N, K): V4-Flash's router and fused compressor inputs, widths off every block, empty ones
CASES = [(1, 256, 4096), (4, 1344, 4096), (2, 5000, 100), (3, 7, 4099), (1, 1, 1), (0, 16, 64), (2, 0, 64),
         (4, 33, 0), (1, 8192, 512)]


def check_against_fp64(device: str, dtype: torch.dtype, cases=CASES) -> None:
    g = torch.Generator().manual_seed(SEED)
    for rows, n, k in cases:
        wide = torch.randn(rows, k + 8, generator=g).to(device, dtype)
        x = wide[:, 3:3 + k]  # strided rows at an odd offset
        w = torch.randn(n, k, generator=g).to(device, dtype)
        with poisoned_empty():
            got = dense_linear(x, w, backend="triton")
        want = (x.double() @ w.double().T)
        assert got.dtype == dtype and got.shape == (rows, n)
        # fp32 accumulation, one rounding to dtype at the end
        tol = k**0.5 * (2**-8 if dtype != torch.float32 else 1e-6)
        torch.testing.assert_close(got.double(), want, rtol=2**-7 if dtype != torch.float32 else 1e-6, atol=tol,
                                   msg=lambda m: f"[{rows}, {n}, {k}] {dtype} (seed {SEED}): {m}")


def test_reference_is_torch_linear_and_keeps_leading_dims():
    x, w = torch.randn(2, 3, 16), torch.randn(5, 16)
    got = dense_linear(x, w)
    assert got.shape == (2, 3, 5) and torch.equal(got, torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.ones(4, 16, dtype=torch.int32)), "x must be"), (dict(w=torch.ones(5, 8)), "weight must be"),
    (dict(w=torch.ones(5, 16).half()), "weight must be"), (dict(w=torch.ones(16, 5).T), "weight must have unit"),
    (dict(x="x"), "x must be a tensor")])
def test_bad_arguments_name_themselves(bad, message):
    args = dict(x=torch.ones(4, 16), w=torch.ones(5, 16)) | bad
    with pytest.raises(ValueError, match=message):
        dense_linear(args["x"], args["w"])


def run_interpreter_cases() -> None:
    check_against_fp64("cpu", torch.float32, [case for case in CASES if case[1] * case[2] <= 2**16])


def test_triton_kernel_matches_fp64_in_the_interpreter():
    run_under_interpreter(__file__, SEED)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_kernel_matches_fp64_on_gpu(dtype):
    check_against_fp64("cuda", dtype)


@pytest.mark.gpu
def test_dispatch_takes_triton_at_decode_sizes_only(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    cuda = torch.device("cuda")
    facts = dict(grad=False, dtype=torch.bfloat16)
    assert dispatch.choose("dense_linear", cuda, rows=MAX_ROWS, **facts) == "triton"
    assert dispatch.choose("dense_linear", cuda, rows=MAX_ROWS + 1, **facts) == "reference"
    assert dispatch.choose("dense_linear", cuda, rows=1, grad=True, dtype=torch.bfloat16) == "reference"
    assert dispatch.choose("dense_linear", cuda, rows=1, grad=False, dtype=torch.float32) == "reference"
    w = torch.randn(8, 16, device=cuda, requires_grad=True)
    dense_linear(torch.randn(1, 16, device=cuda), w).sum().backward()  # autograd: torch's GEMM
    assert w.grad is not None


@pytest.mark.gpu
def test_router_sized_gemv_replays_in_a_cuda_graph():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    dense_linear(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dense_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=2**-7, atol=1e-2)


def run_memcheck_case() -> None:
    check_against_fp64("cuda", torch.bfloat16, [(3, 7, 4099), (1, 256, 4096)])
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
