"""Reference sparse_mla_bwd (explicit formulas) against torch.autograd, in float64 at tiny sizes."""

import pytest
import torch

from flashdsa.runtime.kernels import reference, sparse_mla_bwd, sparse_mla_fwd
from flashdsa.testing import assert_flashmla_close, dense_sparse_mla, random_sparse_inputs

BAD_INDICES = dict(invalid=0.2, out_of_range=0.1, duplicates=True)


def autograd_grads(fwd, q, kv, dout):
    """(out, dq, dkv) of ``sum(fwd(q, kv) * dout)`` by torch.autograd."""
    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    out = fwd(q, kv)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    return out.detach(), dq, dkv


def tiny_case(seed, s_q=7, s_kv=40, h_q=3, d_qk=24, topk=16, **options):
    g = torch.Generator().manual_seed(seed)
    q, kv, indices = random_sparse_inputs(s_q, s_kv, h_q, d_qk, topk, torch.float64, generator=g, **options)
    indices[s_q // 2] = -1  # one row with no valid index
    return q, kv, indices


@pytest.mark.parametrize("d_v, options", [(16, BAD_INDICES), (24, {}), (8, dict(duplicates=True))])
def test_bwd_equals_autograd_of_reference_fwd(d_v, options):
    q, kv, indices = tiny_case(d_v, **options)
    sm_scale = 0.3
    dout = torch.randn(q.shape[0], q.shape[1], d_v, dtype=torch.float64)
    out, dq_want, dkv_want = autograd_grads(
        lambda q, kv: reference.sparse_mla_fwd(q, kv, indices, sm_scale, d_v)[0], q, kv, dout)
    # exact lse (float64) isolates the formulas; the public fp32 lse costs ~1e-7 relative
    lse64 = dense_sparse_mla(q, kv, indices, sm_scale, d_v)[2]
    dq, dkv = reference.sparse_mla_bwd(q, kv, out, dout, lse64, indices, sm_scale, d_v)
    torch.testing.assert_close(dq, dq_want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dkv, dkv_want, rtol=1e-10, atol=1e-12)
    lse = sparse_mla_fwd(q, kv, indices, sm_scale, d_v, backend="reference")[2]
    dq, dkv = sparse_mla_bwd(q, kv, out, dout, lse, indices, sm_scale, d_v, backend="reference")
    torch.testing.assert_close(dq, dq_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dkv, dkv_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_bwd_equals_autograd_of_dense_masked_attention(seed):
    q, kv, indices = tiny_case(seed, s_q=5, s_kv=20, topk=32, **BAD_INDICES)  # topk > s_kv
    sm_scale, d_v = 0.25, 16
    dout = torch.randn(5, 3, d_v, dtype=torch.float64)
    out, dq_want, dkv_want = autograd_grads(
        lambda q, kv: dense_sparse_mla(q, kv, indices, sm_scale, d_v)[0], q, kv, dout)
    lse = dense_sparse_mla(q, kv, indices, sm_scale, d_v)[2]
    dq, dkv = reference.sparse_mla_bwd(q, kv, out, dout, lse, indices, sm_scale, d_v)
    torch.testing.assert_close(dq, dq_want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dkv, dkv_want, rtol=1e-10, atol=1e-12)


def test_bwd_bf16_matches_float64_within_flashmla_tolerance():
    g = torch.Generator().manual_seed(3)
    q, kv, indices = random_sparse_inputs(9, 300, 16, 576, 128, torch.bfloat16, generator=g, invalid=0.1)
    sm_scale, d_v = 576**-0.5, 512
    out, _, lse = sparse_mla_fwd(q, kv, indices, sm_scale, d_v, backend="reference")
    dout = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    dq, dkv = sparse_mla_bwd(q, kv, out, dout, lse, indices, sm_scale, d_v, backend="reference")
    assert dq.dtype == dkv.dtype == torch.bfloat16 and dkv.shape == kv.shape
    dq64, dkv64 = reference.sparse_mla_bwd(q.double(), kv.double(), out.double(), dout.double(), lse, indices,
                                           sm_scale, d_v)
    assert_flashmla_close("dq", dq, dq64)
    assert_flashmla_close("dkv", dkv, dkv64)
    unselected = torch.ones(300, dtype=torch.bool)
    unselected[indices[indices >= 0].long()] = False
    assert unselected.any() and torch.equal(dkv[unselected], torch.zeros_like(dkv[unselected]))


def test_bwd_with_empty_cache_gives_zero_dq_and_empty_dkv():
    q, kv, indices = tiny_case(4, s_kv=0, out_of_range=0.5)
    out, _, lse = sparse_mla_fwd(q, kv, indices, 0.3, 16, backend="reference")
    dq, dkv = sparse_mla_bwd(q, kv, out, torch.randn_like(out), lse, indices, 0.3, 16, backend="reference")
    assert torch.equal(dq, torch.zeros_like(q)) and dkv.shape == (0, 1, 24)


def test_bwd_chunking_and_determinism():
    q, kv, indices = tiny_case(5, s_q=11, **BAD_INDICES)
    out, _, lse = sparse_mla_fwd(q, kv, indices, 0.3, 16, backend="reference")
    dout = torch.randn_like(out)
    args = (q, kv, out, dout, lse, indices, 0.3, 16)
    whole = reference.sparse_mla_bwd(*args, chunk=11)
    for a, b in zip(reference.sparse_mla_bwd(*args, chunk=3), whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    first = sparse_mla_bwd(*args, deterministic=True, backend="reference")
    second = sparse_mla_bwd(*args, deterministic=True, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
