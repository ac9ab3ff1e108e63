"""mHC ops (hc_pre, hc_post, hc_head): the Triton kernels against the torch reference, the Sinkhorn
result's sums, and the argument checks.

Fresh random inputs every run (the seed is printed on failure) over T = 0, 1, 3, 37, 128, n = 1, 2,
4, 8, D from 64 to 4096 with non-powers of two, bf16 and fp32 streams; outputs the kernels allocate
start as NaN (``torch.empty`` poisoned under the interpreter, the CUDA allocator flooded on a GPU).
The CPU test runs the kernels in a TRITON_INTERPRET=1 subprocess; GPU tests are marked ``gpu``.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashdsa.models.hyper_connections import HyperConnection, HyperHead
from flashdsa.runtime.hyper import hc_head, hc_post, hc_pre
from flashdsa.testing import flood_cuda_allocator_with_nan, kernel_test_main, poisoned_empty, run_under_interpreter

SEED = int.from_bytes(os.urandom(4), "little")
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6


def random_site(tokens: int, n: int, dim: int, dtype: torch.dtype, device, head: bool = False):
    """Streams and mixing weights of one site (a head's with ``head``) at V4's magnitudes."""
    g = torch.Generator().manual_seed(SEED + 7919 * tokens + 31 * n + dim)
    width, scales = (n, 1) if head else ((2 + n) * n, 3)
    h = torch.randn(tokens, n, dim, generator=g).to(dtype)
    fn = torch.randn(width, n * dim, generator=g) * (n * dim) ** -0.5
    base = torch.randn(width, generator=g) * 0.5
    scale = 1 + 0.1 * torch.randn(scales, generator=g)
    return [t.to(device) for t in (h, fn, base, scale)]


def assert_streams_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32: ~1e-5; bf16: two roundings apart (the reference's own bf16 steps: a sum's order may move a
    value across a rounding boundary, and on the GPU cuBLAS's bf16 matmul rounds its sum once more:
    2 ulps seen at T 128, D 4096 on an H100)."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape}"
    tol = 2**-6 if got.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what} (seed {SEED}): {m}")


def check_pre_post(tokens: int, n: int, dim: int, dtype: torch.dtype, device, iters: int = ITERS) -> None:
    """``iters`` < 20 leaves Sinkhorn short of convergence, so a kernel off by one iteration fails."""
    h, fn, base, scale = random_site(tokens, n, dim, dtype, device)
    flood_cuda_allocator_with_nan(torch.device(device))
    got = hc_pre(h, fn, base, scale, iters, HC_EPS, NORM_EPS, backend="triton")
    want = hc_pre(h, fn, base, scale, iters, HC_EPS, NORM_EPS, backend="reference")
    assert_streams_close(got[0], want[0], f"collapsed T={tokens} n={n} D={dim}")
    for name, ours, theirs in (("post", got[1], want[1]), ("comb", got[2], want[2])):
        assert_streams_close(ours, theirs, f"{name} T={tokens} n={n} D={dim}")
    comb = got[2]
    ones = torch.ones(tokens, n, device=device)
    # the last Sinkhorn step normalizes the columns; the rows get close over 20 iterations, slowest for
    # skewed 2 x 2 matrices (a random one missed 1e-2 by 0.0016 in CI): the kernel's rows must be as
    # close to 1 as the reference's own, or within 1e-2
    torch.testing.assert_close(comb.sum(-2), ones, rtol=0, atol=1e-5)
    if iters >= ITERS:
        reference_gap = (want[2].sum(-1) - 1).abs().max().item() if tokens else 0.0
        torch.testing.assert_close(comb.sum(-1), ones, rtol=0, atol=max(1e-2, reference_gap + 1e-5))
    y = torch.randn(tokens, dim + 8, dtype=dtype, device=device)[:, :dim]  # strided rows
    flood_cuda_allocator_with_nan(torch.device(device))
    assert_streams_close(hc_post(y, h, got[1], got[2], backend="triton"),
                         hc_post(y, h, got[1], got[2], backend="reference"), f"post T={tokens} n={n} D={dim}")
    # a second block output (V4's shared expert): bit for bit the kernel on torch's rounded sum
    extra = torch.randn(tokens, dim + 4, dtype=dtype, device=device)[:, :dim]
    flood_cuda_allocator_with_nan(torch.device(device))
    fused = hc_post(y, h, got[1], got[2], extra=extra, backend="triton")
    assert torch.equal(fused, hc_post(y + extra, h, got[1], got[2], backend="triton")), f"extra: seed {SEED}"
    assert_streams_close(fused, hc_post(y, h, got[1], got[2], extra=extra, backend="reference"),
                         f"post + extra T={tokens} n={n} D={dim}")


def check_head(tokens: int, n: int, dim: int, dtype: torch.dtype, device) -> None:
    site = random_site(tokens, n, dim, dtype, device, head=True)
    flood_cuda_allocator_with_nan(torch.device(device))
    got = hc_head(*site, HC_EPS, NORM_EPS, backend="triton")
    assert_streams_close(got, hc_head(*site, HC_EPS, NORM_EPS, backend="reference"), f"head T={tokens} n={n} D={dim}")


CPU_CASES = [(1, 4, 64, torch.float32), (3, 4, 448, torch.bfloat16), (37, 2, 100, torch.float32),
             (128, 4, 64, torch.bfloat16), (5, 8, 64, torch.float32), (2, 1, 96, torch.float32),
             (3, 4, 4096, torch.float32), (0, 4, 64, torch.bfloat16)]
FEW_ITERS = 2  # the T = 128 case: also what an off-by-one Sinkhorn loop would miss at 20
GPU_CASES = [(t, 4, 4096, dtype) for t in (1, 3, 32, 37, 128, 4096) for dtype in (torch.bfloat16, torch.float32)] + [
    (37, 2, 448, torch.bfloat16), (64, 8, 1000, torch.float32), (1, 4, 7168, torch.bfloat16)]


def run_interpreter_cases() -> None:
    with poisoned_empty():
        for case in CPU_CASES:
            check_pre_post(*case, "cpu", iters=FEW_ITERS if case[0] == 128 else ITERS)
            check_head(*case, "cpu")
    print("interpreter cases passed")


def test_kernels_match_reference_under_interpreter():
    run_under_interpreter(__file__, SEED)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, n, dim, dtype", GPU_CASES)
def test_kernels_match_reference_on_gpu(tokens, n, dim, dtype):
    check_pre_post(tokens, n, dim, dtype, "cuda")
    check_pre_post(tokens, n, dim, dtype, "cuda", iters=FEW_ITERS)
    check_head(tokens, n, dim, dtype, "cuda")


def test_modules_use_the_differentiable_reference_under_autograd():
    """Training backpropagates through the modules (the reference path); with no grad they give the same."""
    site = HyperConnection(32, 4, ITERS, HC_EPS, NORM_EPS)
    head = HyperHead(32, 4, HC_EPS, NORM_EPS)
    for module in (site, head):
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.1)
    h = torch.randn(3, 4, 32, requires_grad=True)
    x, post, comb = site(h)
    loss = x.square().sum() + post.sum() + (comb * torch.randn(3, 4, 4)).sum() + head(h).sum()
    loss = loss + HyperConnection.expand(x, h, post, comb).square().sum()
    loss.backward()
    assert h.grad is not None and site.fn.grad is not None and head.hc_fn.grad is not None
    assert torch.isfinite(site.fn.grad).all() and site.fn.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(site(h)[0], x.detach())


@pytest.mark.parametrize("change, message", [
    (dict(h=torch.ones(2, 4, 8, dtype=torch.int32)), "h must be"),
    (dict(h=torch.ones(2, 4, 16).transpose(1, 2)), "h must be"),
    (dict(fn=torch.ones(24, 31)), "fn must be"),
    (dict(fn=torch.ones(24, 32, dtype=torch.float64)), "fn must be"),
    (dict(base=torch.ones(23)), "base must be"),
    (dict(scale=torch.ones(1)), "scale must be"),
    (dict(iters=0), "iters must be"),
    (dict(iters=2.0), "iters must be"),
    (dict(hc_eps=-1e-6), "hc_eps must be"),
    (dict(norm_eps=0.0), "norm_eps must be")])
def test_hc_pre_bad_arguments_name_themselves(change, message):
    args = dict(h=torch.ones(2, 4, 8), fn=torch.ones(24, 32), base=torch.ones(24), scale=torch.ones(3), iters=20,
                hc_eps=1e-6, norm_eps=1e-6) | change
    with pytest.raises(ValueError, match=message):
        hc_pre(**args)


@pytest.mark.parametrize("change, message", [
    (dict(y=torch.ones(2, 8, dtype=torch.bfloat16)), "y must be"), (dict(y=torch.ones(3, 8)), "y must be"),
    (dict(y=torch.ones(8, 2).t()), "y must have a contiguous last dim"),
    (dict(extra=torch.ones(2, 8, dtype=torch.bfloat16)), "extra must be"), (dict(extra=torch.ones(2, 7)), "extra must be"),
    (dict(extra=torch.ones(8, 2).t()), "extra must have a contiguous last dim"),
    (dict(post=torch.ones(2, 3)), "post must be"), (dict(comb=torch.ones(2, 4, 4, dtype=torch.bfloat16)), "comb must be")])
def test_hc_post_bad_arguments_name_themselves(change, message):
    args = dict(y=torch.ones(2, 8), h=torch.ones(2, 4, 8), post=torch.ones(2, 4), comb=torch.ones(2, 4, 4)) | change
    with pytest.raises(ValueError, match=message):
        hc_post(**args)


def test_hc_head_bad_arguments_and_too_many_streams_for_triton(monkeypatch):
    with pytest.raises(ValueError, match="scale must be"):
        hc_head(torch.ones(2, 4, 8), torch.ones(4, 32), torch.ones(4), torch.ones(3), 1e-6, 1e-6)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to the backend's own limit
    with pytest.raises(ValueError, match="n <= 8"):
        hc_head(torch.ones(2, 9, 8), torch.ones(9, 72), torch.ones(9), torch.ones(1), 1e-6, 1e-6, backend="triton")


def run_memcheck_case() -> None:
    check_pre_post(37, 4, 4096, torch.bfloat16, "cuda")
    check_head(3, 4, 448, torch.float32, "cuda")
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
