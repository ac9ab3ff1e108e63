"""Reference sparse_mla_fwd against an independent dense float64 oracle (count-matrix softmax)."""

import math

import pytest
import torch

from flashdsa.runtime.kernels import reference, sparse_mla_fwd
from flashdsa.testing import (
    assert_flashmla_close,
    assert_lse_close,
    dense_sparse_mla,
    random_sparse_inputs,
)

D_V = 512


def check_against_dense(q, kv, indices, d_v=D_V):
    sm_scale = q.shape[-1] ** -0.5
    out, max_logits, lse = sparse_mla_fwd(q, kv, indices, sm_scale, d_v, backend="reference")
    ref_out, ref_max, ref_lse = dense_sparse_mla(q, kv, indices, sm_scale, d_v)
    assert out.dtype == q.dtype and max_logits.dtype == lse.dtype == torch.float32
    assert_flashmla_close("out", out, ref_out)
    assert_lse_close(max_logits, ref_max, "max_logits")
    assert_lse_close(lse, ref_lse)
    return out, max_logits, lse


@pytest.mark.parametrize(
    "s_q, s_kv, h_q, d_qk, topk, dtype",
    [
        (1, 300, 64, 576, 64, torch.bfloat16),
        (62, 600, 128, 576, 512, torch.bfloat16),
        (37, 700, 64, 512, 256, torch.float32),
        (13, 90, 3, 576, 128, torch.float32),  # topk > s_kv: the tail is -1
        (5, 2000, 64, 512, 192, torch.bfloat16),
    ],
)
def test_fwd_matches_dense_oracle(s_q, s_kv, h_q, d_qk, topk, dtype):
    g = torch.Generator().manual_seed(s_q * 1000 + topk)
    check_against_dense(*random_sparse_inputs(s_q, s_kv, h_q, d_qk, topk, dtype, generator=g))


@pytest.mark.parametrize("options", [
    dict(invalid=0.3),
    dict(out_of_range=0.3),
    dict(duplicates=True),
    dict(invalid=0.2, out_of_range=0.2, duplicates=True),
])
def test_fwd_matches_dense_oracle_with_bad_and_duplicate_indices(options):
    g = torch.Generator().manual_seed(7)
    check_against_dense(*random_sparse_inputs(11, 200, 16, 576, 128, torch.float32, generator=g, **options))


def test_all_invalid_rows_give_zero_out_and_inf_lse():
    g = torch.Generator().manual_seed(1)
    q, kv, indices = random_sparse_inputs(6, 100, 8, 576, 64, torch.bfloat16, generator=g)
    indices[1] = -1
    indices[4] = torch.tensor([100, -5] * 32, dtype=torch.int32)  # only out-of-range values
    out, max_logits, lse = check_against_dense(q, kv, indices)
    for row in (1, 4):
        assert torch.equal(out[row], torch.zeros_like(out[row]))
        assert torch.isposinf(lse[row]).all() and torch.isneginf(max_logits[row]).all()
    assert torch.isfinite(lse[[0, 2, 3, 5]]).all()


def test_empty_cache_makes_every_index_invalid():
    g = torch.Generator().manual_seed(2)
    q, kv, indices = random_sparse_inputs(4, 0, 8, 512, 64, torch.float32, generator=g, out_of_range=0.5)
    out, max_logits, lse = check_against_dense(q, kv, indices)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all() and torch.isneginf(max_logits).all()


def test_out_of_range_indices_act_exactly_like_minus_one():
    g = torch.Generator().manual_seed(3)
    q, kv, indices = random_sparse_inputs(9, 150, 4, 576, 64, torch.float32, generator=g, out_of_range=0.4)
    wild = (indices < 0) | (indices >= 150)
    assert wild.any() and (indices < -1).any() and (indices >= 150).any()
    got = check_against_dense(q, kv, indices)
    want = reference.sparse_mla_fwd(q, kv, indices.masked_fill(wild, -1), 576**-0.5, D_V)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_duplicate_indices_count_once_per_occurrence():
    g = torch.Generator().manual_seed(4)
    q, kv, _ = random_sparse_inputs(2, 10, 4, 576, 64, torch.float64, generator=g)
    sm_scale = 0.05
    indices = torch.full((2, 1, 64), -1, dtype=torch.int32)
    indices[0, 0, :3] = torch.tensor([3, 3, 7])  # row 3 weighs twice as much as row 7
    indices[1, 0, :] = 5  # one row 64 times: softmax is exactly that row
    out, _, lse = reference.sparse_mla_fwd(q, kv, indices, sm_scale, D_V)
    s3, s7 = (q[0] @ kv[3, 0]) * sm_scale, (q[0] @ kv[7, 0]) * sm_scale
    w3 = 2 * s3.exp() / (2 * s3.exp() + s7.exp())
    torch.testing.assert_close(out[0], w3[:, None] * kv[3, 0, :D_V] + (1 - w3)[:, None] * kv[7, 0, :D_V])
    torch.testing.assert_close(out[1], kv[5, 0, :D_V].expand(4, -1))
    s5 = (q[1] @ kv[5, 0]) * sm_scale
    torch.testing.assert_close(lse[1], (s5 + math.log(64)).float())


def test_small_d_v_and_d_qk_for_shrunk_models():
    g = torch.Generator().manual_seed(5)
    check_against_dense(*random_sparse_inputs(7, 50, 2, 48, 16, torch.float32, generator=g), d_v=32)


@pytest.mark.parametrize("chunk", [1, 3])
def test_chunking_gives_the_same_result_as_one_chunk(chunk):
    g = torch.Generator().manual_seed(6)
    q, kv, indices = random_sparse_inputs(10, 300, 16, 576, 128, torch.float32, generator=g, invalid=0.1)
    whole = reference.sparse_mla_fwd(q, kv, indices, 0.04, D_V, chunk=10)
    chunked = reference.sparse_mla_fwd(q, kv, indices, 0.04, D_V, chunk=chunk)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_chunk_budget_bounds_memory_of_a_long_prefill():
    rows = reference._rows_per_chunk(128, 2048, 576, torch.float32, None)
    per_row_bytes = (2048 * 576 + 128 * 2048) * 4
    assert 1 <= rows < 4096 and rows * per_row_bytes <= reference.MEMORY_BUDGET
