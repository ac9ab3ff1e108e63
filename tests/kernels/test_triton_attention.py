"""Triton sparse MLA forward and backward, and the native (CUDA, SM90) forward and backward, against
the reference backend.

GPU tests (marked ``gpu``) walk grids of heads, widths, top-k and query counts plus corner cases
and a long context; outputs land in poisoned (NaN) memory. Forward tests run on each backend
(``cuda``: Hopper only, h_q 64 and 128), plus the native forward's own cases: top-k not a multiple
of 64 and up to 16384, 70000 query rows, CUDA-graph replay. Backward tests run on both backends
too (``cuda``: the native dq and dkv kernels; Hopper, h_q 64 and 128), and each native step against
Triton's on the same inputs. The CPU
test runs a few tiny cases of
the same checks in a subprocess with TRITON_INTERPRET=1 (set before triton is imported there,
so other test files in this pytest run keep the normal triton).

Backward tolerance: the kernel rounds P and dS to bf16 before its matrix products (as FlashMLA
and FlashAttention do) and returns bf16, so each element carries ~2^-9 relative error from
several roundings summed over up to topk terms: we allow 2/128 relative or 5% of the reference's
RMS absolute per element, and a cosine distance of 1e-4 over the tensor (a single lost or extra
contribution breaks the latter).
"""

from __future__ import annotations

import functools
import itertools
import os

import pytest
import torch

from flashdsa.runtime.kernels import reference, sparse_mla_bwd, sparse_mla_fwd
from flashdsa.testing import (
    assert_flashmla_close,
    assert_lse_close,
    flood_cuda_allocator_with_nan,
    kernel_test_main,
    random_sparse_inputs,
    run_under_interpreter,
)

D_V = 512
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


def cuda_forward_serves(h_q: int) -> bool:
    """Whether this GPU and head count are the native forward's (SM90, h_q 64 or 128)."""
    return torch.cuda.get_device_capability() == (9, 0) and h_q in (64, 128)


def check_fwd(q, kv, indices, sm_scale=None, out_abs_tol=1e-3, backend="triton"):
    """A backend's forward vs the reference on fp32 copies of the same inputs (FlashMLA tolerances)."""
    sm_scale = sm_scale or q.shape[-1] ** -0.5
    if backend == "cuda" and not cuda_forward_serves(q.shape[1]):
        pytest.skip("the cuda forward serves SM90 and h_q 64 or 128")
    flood_cuda_allocator_with_nan(q.device)
    out, max_logits, lse = sparse_mla_fwd(q, kv, indices, sm_scale, D_V, backend=backend)
    ref = reference.sparse_mla_fwd(q.float(), kv.float(), indices, sm_scale, D_V)
    assert out.dtype == q.dtype and max_logits.dtype == lse.dtype == torch.float32
    assert_flashmla_close("out", out, ref[0], abs_tol=out_abs_tol)
    assert_lse_close(max_logits, ref[1], "max_logits")
    assert_lse_close(lse, ref[2])
    return out, max_logits, lse


def assert_grad_close(name, got, ref):
    rms = ref.double().pow(2).mean().sqrt().item()
    assert_flashmla_close(name, got, ref, abs_tol=0.05 * rms, rel_tol=2 / 128, cos_tol=1e-4)


def check_bwd(q, kv, indices, deterministic=False, backend="triton"):
    """A backend's backward vs the reference backward given the same out, dout and lse."""
    sm_scale = q.shape[-1] ** -0.5
    if backend == "cuda" and not cuda_forward_serves(q.shape[1]):
        pytest.skip("the cuda backward serves SM90 and h_q 64 or 128")
    long_list = indices.shape[-1] > 8192  # past the Triton kernels' top-k: the native ones only
    if long_list and backend == "triton":
        pytest.skip("the triton backward takes topk up to 8192")
    out, _, lse = sparse_mla_fwd(q, kv, indices, sm_scale, D_V, backend="cuda" if long_list else "triton")
    dout = torch.randn_like(out)
    flood_cuda_allocator_with_nan(q.device)
    dq, dkv = sparse_mla_bwd(q, kv, out, dout, lse, indices, sm_scale, D_V,
                             deterministic=deterministic, backend=backend)
    ref_dq, ref_dkv = reference.sparse_mla_bwd(q.float(), kv.float(), out.float(), dout.float(), lse, indices,
                                               sm_scale, D_V)
    assert dq.dtype == dkv.dtype == q.dtype
    assert_grad_close("dq", dq, ref_dq)
    assert_grad_close("dkv", dkv, ref_dkv)
    return out, dout, lse, dkv


def assert_refuses(call, good: tuple, cases: list) -> None:
    """``call(*good)`` runs; each (argument position, bad value, message) of ``cases`` in place of the
    good argument raises a RuntimeError whose text matches the message."""
    call(*good)
    for at, bad, message in cases:
        args = list(good)
        args[at] = bad
        with pytest.raises(RuntimeError, match=message):
            call(*args)


def inputs(s_q, s_kv, h_q, d_qk, topk, device, scale=0.1, **options):
    """Random bf16 inputs; q and kv scaled by 1/10 as in FlashMLA's tests, whose tolerances assume it."""
    g = torch.Generator().manual_seed(SEED + s_q * 7919 + h_q * 31 + topk)
    q, kv, indices = random_sparse_inputs(s_q, s_kv, h_q, d_qk, topk, torch.float32, generator=g, **options)
    return (q * scale).to(device, torch.bfloat16), (kv * scale).to(device, torch.bfloat16), indices.to(device)


# (h_q, d_qk, topk) grid; s_q cycles through 1, 62 and an odd count; some contexts shorter than topk
FWD_GRID = [(h, d, k, (1, 62, 37)[i % 3], (4096, 300)[i % 5 == 4])
            for i, (h, d, k) in enumerate(itertools.product((16, 64, 128, 7), (512, 576), (64, 512, 2048)))]
BWD_GRID = [(16, 576, 64, 62, 1000), (64, 512, 512, 37, 4096), (128, 576, 2048, 5, 8192), (7, 576, 128, 1, 100),
            (128, 576, 256, 62, 2000), (128, 512, 128, 70, 300), (64, 576, 64, 1, 50), (128, 576, 192, 9, 500),
            (64, 512, 320, 11, 700),  # 3 and 5 tiles of 64: the native dkv's stages and warpgroups wrap oddly
            (64, 576, 10240, 2, 12000)]  # past Triton's 8192 (cuda only)
BAD_INDICES = [dict(invalid=0.3), dict(out_of_range=0.3), dict(duplicates=True),
               dict(invalid=0.2, out_of_range=0.2, duplicates=True)]

gpu = pytest.mark.gpu
cuda = torch.device("cuda")
fwd_backends = pytest.mark.parametrize("backend", ["triton", "cuda"])
bwd_backends = fwd_backends


@gpu
@fwd_backends
@pytest.mark.parametrize("h_q, d_qk, topk, s_q, s_kv", FWD_GRID)
def test_fwd_matches_reference(h_q, d_qk, topk, s_q, s_kv, backend):
    check_fwd(*inputs(s_q, s_kv, h_q, d_qk, topk, cuda), backend=backend)


@gpu
@fwd_backends
@pytest.mark.parametrize("options", BAD_INDICES)
def test_fwd_masks_invalid_and_counts_duplicate_indices(options, backend):
    check_fwd(*inputs(33, 500, 128, 576, 256, cuda, **options), backend=backend)


@gpu
@fwd_backends
def test_fwd_rows_without_valid_index_give_zero_out_and_inf_lse(backend):
    q, kv, indices = inputs(8, 700, 64, 576, 128, cuda, invalid=0.1)
    indices[2] = -1
    indices[5] = torch.tensor([700, -7] * 64, dtype=torch.int32)
    out, max_logits, lse = check_fwd(q, kv, indices, backend=backend)
    assert torch.equal(out[[2, 5]], torch.zeros_like(out[[2, 5]]))
    assert torch.isposinf(lse[[2, 5]]).all() and torch.isneginf(max_logits[[2, 5]]).all()


@gpu
@fwd_backends
def test_fwd_empty_cache_gives_empty_rows(backend):
    q, kv, indices = inputs(3, 0, 64, 512, 64, cuda, out_of_range=0.5)
    out, max_logits, lse = check_fwd(q, kv, indices, backend=backend)
    assert not out.any() and torch.isposinf(lse).all() and torch.isneginf(max_logits).all()


@gpu
@fwd_backends
@pytest.mark.parametrize("sm_scale, out_abs_tol", [(576 ** -0.5, 4e-3), (0.3, 2e-2)])
def test_fwd_peaked_softmax_rescales_running_max(sm_scale, out_abs_tol, backend):
    """Unscaled inputs: scores of std 1 and 7 make the running max move a lot between steps.
    With P rounded to bf16 and a few keys dominating, errors no longer average out: outputs of
    magnitude ~1 err up to ~4e-3 (std-1 scores) and, once seen, 1.4e-2 on 1 of 2.9M elements
    (std-7 scores); the cosine bound (1e-5) stays as strict as FlashMLA's."""
    check_fwd(*inputs(45, 3000, 128, 576, 1024, cuda, scale=1.0), sm_scale=sm_scale, out_abs_tol=out_abs_tol,
              backend=backend)


@gpu
@fwd_backends
def test_fwd_long_context(backend):
    check_fwd(*inputs(64, 65536, 128, 576, 2048, cuda), backend=backend)


@gpu
@pytest.mark.parametrize("h_q, d_qk, topk, s_q, s_kv", [(128, 576, 100, 7, 300), (64, 512, 1000, 5, 1500),
                                                        (128, 576, 16384, 3, 20000), (64, 576, 5, 9, 40)])
def test_cuda_fwd_takes_any_topk_up_to_16384(h_q, d_qk, topk, s_q, s_kv):
    check_fwd(*inputs(s_q, s_kv, h_q, d_qk, topk, cuda, invalid=0.1), backend="cuda")


@gpu
def test_cuda_fwd_70000_query_rows():
    """More query rows than a grid's y or z may hold; inputs drawn on the GPU, and the reference
    checks the first, the last and a random sample of rows (rows are independent)."""
    if not cuda_forward_serves(64):
        pytest.skip("the cuda forward serves SM90")
    rows, s_kv = 70000, 3000
    g = torch.Generator(device=cuda).manual_seed(SEED)
    q = torch.randn(rows, 64, 576, device=cuda, dtype=torch.bfloat16, generator=g) / 10
    kv = torch.randn(s_kv, 1, 576, device=cuda, dtype=torch.bfloat16, generator=g) / 10
    indices = torch.randint(-1, s_kv + 5, (rows, 1, 128), device=cuda, dtype=torch.int32, generator=g)
    flood_cuda_allocator_with_nan(cuda)
    out, max_logits, lse = sparse_mla_fwd(q, kv, indices, 576**-0.5, D_V, backend="cuda")
    pick = torch.cat([torch.arange(64), torch.arange(rows - 64, rows), torch.randperm(rows)[:128]]).to(cuda)
    ref = reference.sparse_mla_fwd(q[pick].float(), kv.float(), indices[pick], 576**-0.5, D_V)
    assert_flashmla_close("out", out[pick], ref[0])
    assert_lse_close(max_logits[pick], ref[1], "max_logits")
    assert_lse_close(lse[pick], ref[2])


@gpu
def test_cuda_fwd_replays_in_a_cuda_graph():
    q, kv, indices = inputs(40, 3000, 128, 576, 512, cuda)
    first = check_fwd(q, kv, indices, backend="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sparse_mla_fwd(q, kv, indices, q.shape[-1] ** -0.5, D_V, backend="cuda")
    for got in captured:
        got.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, first):
        assert torch.equal(got, want)


@gpu
@bwd_backends
@pytest.mark.parametrize("h_q, d_qk, topk, s_q, s_kv", BWD_GRID)
def test_bwd_matches_reference(h_q, d_qk, topk, s_q, s_kv, backend):
    check_bwd(*inputs(s_q, s_kv, h_q, d_qk, topk, cuda, invalid=0.05), backend=backend)


@gpu
@bwd_backends
@pytest.mark.parametrize("options", BAD_INDICES)
def test_bwd_masks_invalid_and_counts_duplicate_indices(options, backend):
    check_bwd(*inputs(21, 300, 64, 576, 128, cuda, **options), backend=backend)


@gpu
@bwd_backends
def test_bwd_long_context(backend):
    check_bwd(*inputs(16, 65536, 128, 576, 2048, cuda), backend=backend)


@gpu
@bwd_backends
@pytest.mark.parametrize("h_q, d_qk", [(128, 576), (16, 512), (64, 512), (64, 576), (128, 512)])
def test_bwd_deterministic_is_bitwise_reproducible(h_q, d_qk, backend):
    q, kv, indices = inputs(40, 200, h_q, d_qk, 256, cuda, duplicates=True, invalid=0.1)
    out, dout, lse, dkv = check_bwd(q, kv, indices, deterministic=True, backend=backend)
    for _ in range(2):
        _, again = sparse_mla_bwd(q, kv, out, dout, lse, indices, d_qk ** -0.5, D_V, deterministic=True,
                                  backend=backend)
        assert torch.equal(again, dkv)


@gpu
@bwd_backends
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_in_token_chunks_matches_reference(monkeypatch, deterministic, backend):
    """A scratch budget of 3 tokens: the backward runs 4 chunks (the last short), so every chunk after
    the first starts at token0 > 0 in the dq and dkv steps."""
    from flashdsa.runtime.kernels.triton import sparse_bwd as triton_bwd

    h_q, d_qk, topk = 64, 576, 128
    per_token = h_q * topk * 4 + (topk * d_qk * 4 if deterministic else 0)
    monkeypatch.setattr(triton_bwd, "SCRATCH_BYTES", 3 * per_token)
    check_bwd(*inputs(10, 400, h_q, d_qk, topk, cuda, invalid=0.1, duplicates=True), deterministic, backend=backend)


@gpu
@pytest.mark.parametrize("h_q, d_qk, topk", [(64, 576, 192), (128, 576, 192), (64, 512, 192), (128, 512, 160)])
def test_cuda_dq_step_equals_triton_dq_step(h_q, d_qk, topk):
    """The dq step alone, native vs Triton, on tokens [2, 7) of 9 (token0 > 0), one of them with no
    valid slot (lse +inf: dq, P and dS 0): the chunk's dq rows and the P and dS scratch it leaves for
    the dkv step. topk 160 is an odd number of the native kernel's 32-key tiles."""
    if not cuda_forward_serves(h_q):
        pytest.skip("the cuda backward serves SM90")
    from flashdsa.runtime.kernels.cuda import sparse_bwd as cuda_bwd
    from flashdsa.runtime.kernels.triton import sparse_bwd as triton_bwd

    s_q, s_kv, token0, tokens, sm_scale = 9, 300, 2, 5, d_qk ** -0.5
    q, kv, indices = inputs(s_q, s_kv, h_q, d_qk, topk, cuda, invalid=0.1, out_of_range=0.1, duplicates=True)
    indices[4] = -1
    out, _, lse = reference.sparse_mla_fwd(q, kv, indices, sm_scale, D_V)
    dout = torch.randn_like(out)
    kv2, idx2 = kv.view(s_kv, d_qk), indices.view(s_q, topk)
    # Triton's default 64-key tiles where topk allows, else 32 (160 = 5 tiles)
    triton_dq = functools.partial(triton_bwd.triton_dq, block_n=32 if topk % 64 else None)
    results = []
    for stage in (cuda_bwd.native_dq, triton_dq):
        flood_cuda_allocator_with_nan(cuda)
        dq = torch.empty_like(q)
        p, ds = (torch.empty(tokens * h_q * topk, device=cuda, dtype=torch.bfloat16) for _ in range(2))
        stage(q, kv2, out, dout, lse, idx2, dq, p, ds, s_kv, sm_scale, token0, tokens)
        results.append((dq[token0:token0 + tokens], p, ds))
    for name, got, want in zip(("dq", "p", "ds"), *results):
        assert_grad_close(name, got, want)


@gpu
@pytest.mark.parametrize("h_q, d_qk", [(64, 576), (128, 576), (64, 512), (128, 512)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_dkv_step_equals_triton_dkv_step_on_the_same_scratch(h_q, d_qk, deterministic):
    """The dkv step alone, native vs Triton, from the same random P and dS scratch of tokens [2, 7)
    of 9 (token0 > 0), fp32 sums of the same bf16 products in another order: a wrong column range,
    head or slot shows far above the tolerance, which the whole backward's looser check could hide."""
    if not cuda_forward_serves(h_q):
        pytest.skip("the cuda backward serves SM90")
    from flashdsa.runtime.kernels.cuda import sparse_bwd as cuda_bwd
    from flashdsa.runtime.kernels.triton import sparse_bwd as triton_bwd

    s_q, s_kv, topk, token0, tokens = 9, 300, 192, 2, 5
    g = torch.Generator(device=cuda).manual_seed(SEED + h_q + d_qk)
    q = torch.randn(s_q, h_q, d_qk, device=cuda, generator=g).bfloat16()
    dout = torch.randn(s_q, h_q, D_V, device=cuda, generator=g).bfloat16()
    idx2 = torch.randint(-20, s_kv + 20, (s_q, topk), device=cuda, dtype=torch.int32, generator=g)
    p = torch.rand(tokens * h_q * topk, device=cuda, generator=g).bfloat16()
    ds = torch.randn(tokens * h_q * topk, device=cuda, generator=g).bfloat16()
    rows = tokens * topk if deterministic else s_kv
    got, want = (torch.zeros(rows, d_qk, device=cuda) for _ in range(2))
    cuda_bwd.native_dkv(q, dout, idx2, p, ds, got, s_kv, token0, tokens, deterministic)
    triton_bwd.triton_dkv(q, dout, idx2, p, ds, want, s_kv, token0, tokens, deterministic)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_triton_dq_step_refuses_a_topk_that_is_not_whole_tiles():
    """The step's index loads and scratch stores cover whole tiles: topk 96 at 64-key tiles would read
    past the index row, so it is refused before any launch (CPU tensors: nothing runs)."""
    from flashdsa.runtime.kernels.triton import sparse_bwd as triton_bwd

    q, kv, indices = inputs(2, 128, 16, 576, 96, torch.device("cpu"))
    out = torch.zeros(2, 16, D_V, dtype=torch.bfloat16)
    scratch, lse = torch.empty(2 * 16 * 96, dtype=torch.bfloat16), torch.zeros(2, 16)
    with pytest.raises(ValueError, match="multiple of block_n 64, got 96"):
        triton_bwd.triton_dq(q, kv.view(128, 576), out, out, lse, indices.view(2, 96), torch.empty_like(q), scratch,
                             scratch, 128, 0.1, 0, 2)


@gpu
def test_cuda_bwd_ops_refuse_bad_arguments_with_their_names():
    if not cuda_forward_serves(64):
        pytest.skip("the cuda backward serves SM90")
    from flashdsa.runtime.kernels.cuda import sparse_bwd

    q, kv, indices = inputs(3, 100, 64, 576, 128, cuda)
    out = torch.zeros(3, 64, D_V, device=cuda, dtype=torch.bfloat16)
    lse = torch.zeros(3, 64, device=cuda)
    scratch = torch.zeros(3 * 64 * 128, device=cuda, dtype=torch.bfloat16)
    kv2, idx2, dq = kv.view(100, 576), indices.view(3, 128), torch.empty_like(q)
    dkv = torch.zeros(100, 576, device=cuda)
    narrow_topk, narrow_dout = idx2[:, :100].contiguous(), out[..., :256].contiguous()
    other = torch.zeros_like(scratch)
    assert_refuses(sparse_bwd.native_dq, (q, kv2, out, out, lse, idx2, dq, scratch, other, 100, 0.1, 0, 3), [
        (1, kv2[:, :512].contiguous(), "kv must be"), (4, lse.double(), "lse must be"),
        (5, narrow_topk, "indices must have topk"), (6, dq.float(), "dq must be"), (7, scratch[:10], "p must be"),
        (10, float("nan"), "sm_scale must be"), (12, 4, "token0 and tokens must"), (3, narrow_dout, "dout must be"),
        (5, torch.zeros(3 * 128 + 1, device=cuda, dtype=torch.int32)[1:].view(3, 128), "indices must start")])
    assert_refuses(sparse_bwd.native_dkv, (q, out, idx2, scratch, scratch, dkv, 100, 0, 3, False), [
        (2, narrow_topk, "indices must have topk"), (3, scratch[:10], "p must be"), (4, scratch.float(), "ds must be"),
        (5, dkv.double(), "dkv must be"), (5, dkv.t(), "dkv must be"), (8, 4, "token0 and tokens must"),
        (7, -1, "token0 and tokens must"), (1, narrow_dout, "dout must be")])


INTERPRETER_CASES = [  # (s_q, s_kv, h_q, d_qk, topk, index options): tiny, the interpreter is slow
    (3, 100, 16, 576, 64, dict(invalid=0.2)),
    (2, 50, 20, 512, 128, dict(out_of_range=0.3, duplicates=True)),
    (1, 30, 80, 576, 64, {}),  # two head blocks, the second padded; topk > s_kv
]


def run_interpreter_cases() -> None:
    """The CPU checks, run in a process with TRITON_INTERPRET=1 (see test_kernels_under_interpreter)."""
    cpu = torch.device("cpu")
    for s_q, s_kv, h_q, d_qk, topk, options in INTERPRETER_CASES:
        q, kv, indices = inputs(s_q, s_kv, h_q, d_qk, topk, cpu, **options)
        check_fwd(q, kv, indices)
        out, dout, lse, dkv = check_bwd(q, kv, indices)
        _, det = sparse_mla_bwd(q, kv, out, dout, lse, indices, d_qk ** -0.5, D_V, deterministic=True,
                                backend="triton")
        assert_grad_close("deterministic dkv", det, dkv.float())
    check_fwd(*inputs(2, 90, 16, 576, 128, cpu, scale=1.0), out_abs_tol=4e-3)  # peaked softmax
    q, kv, indices = inputs(2, 0, 16, 576, 64, cpu)  # empty cache
    out, max_logits, lse = check_fwd(q, kv, indices)
    assert not out.any() and torch.isposinf(lse).all() and torch.isneginf(max_logits).all()


def test_kernels_under_interpreter():
    run_under_interpreter(__file__, SEED)


def run_memcheck_case() -> None:
    """A small GPU case full of invalid indices for ``compute-sanitizer --tool memcheck`` (run with
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 so every tensor is its own allocation)."""
    q, kv, indices = inputs(5, 70, 128, 576, 128, cuda, invalid=0.3, out_of_range=0.3, duplicates=True)
    for deterministic in (False, True):
        check_bwd(q, kv, indices, deterministic)
    if cuda_forward_serves(q.shape[1]):
        for deterministic in (False, True):
            check_bwd(q, kv, indices, deterministic, backend="cuda")
        for d_qk in (576, 512):
            check_fwd(q[..., :d_qk].contiguous(), kv[..., :d_qk].contiguous(), indices, backend="cuda")
        empty = kv[:0]
        check_fwd(q, empty, indices, backend="cuda")
    torch.cuda.synchronize()
    print("memcheck case ran")


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case, patch=False)
