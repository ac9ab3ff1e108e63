"""The Triton attention kernels at the largest query counts the contract promises (s_q up to
70000): every row of the grid is computed, none is dropped by a grid-size overflow."""

from __future__ import annotations

import pytest
import torch

from flashdsa.runtime.kernels import reference, sparse_mla_bwd, sparse_mla_decode, sparse_mla_fwd
from flashdsa.testing import (
    assert_flashmla_close, assert_lse_close, flood_cuda_allocator_with_nan, random_mla_cache, random_sparse_inputs,
)

S_Q = 70_000


@pytest.mark.gpu
def test_fwd_and_bwd_cover_70000_query_rows():
    q, kv, idx = random_sparse_inputs(S_Q, 4096, 16, 576, 64, device="cuda", invalid=0.05)
    q, kv = q * 0.1, kv * 0.1  # FlashMLA's test scale, where its tolerances apply
    scale = 576 ** -0.5
    flood_cuda_allocator_with_nan(torch.device("cuda"))  # outputs allocated next start as NaN
    out, max_logits, lse = sparse_mla_fwd(q, kv, idx, scale, backend="triton")
    ref = reference.sparse_mla_fwd(q.float(), kv.float(), idx, scale)
    assert_flashmla_close("out", out, ref[0])
    assert_lse_close(lse, ref[2])
    dout = torch.randn_like(out)
    dq, dkv = sparse_mla_bwd(q, kv, out, dout, lse, idx, scale, backend="triton")
    ref_dq, ref_dkv = reference.sparse_mla_bwd(q, kv, out, dout, lse, idx, scale)
    for name, got, want in (("dq", dq, ref_dq), ("dkv", dkv, ref_dkv)):
        rms = want.double().pow(2).mean().sqrt().item()
        assert_flashmla_close(name, got, want, abs_tol=0.05 * rms, rel_tol=2 / 128, cos_tol=1e-4)


@pytest.mark.gpu
def test_decode_covers_70000_query_rows():
    cache = random_mla_cache(64, device="cuda", scale=0.1)  # the scale FlashMLA's tolerances assume
    flood_cuda_allocator_with_nan(torch.device("cuda"))
    q = (torch.randn(S_Q // 2, 2, 16, 576, device="cuda") * 0.1).bfloat16()
    slots = torch.randint(-1, 64 * 64, (S_Q // 2, 2, 64), device="cuda", dtype=torch.int32)
    out, lse = sparse_mla_decode(q, cache, slots, 576 ** -0.5, backend="triton")
    ref_out, ref_lse = reference.sparse_mla_decode(q.float(), cache, slots, 576 ** -0.5)
    assert_flashmla_close("out", out, ref_out)
    assert_lse_close(lse, ref_lse)
