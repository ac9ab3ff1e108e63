"""indexer_topk and indexer_fused_topk: top-k sets equal torch.topk in float64, ties go to the
lower position, results sorted by descending score, -1 padded, only in-range positions."""

import pytest
import torch

from flashdsa.runtime.indexer import (
    hadamard_transform,
    indexer_fused_topk,
    indexer_logits,
    indexer_topk,
    quantize_indexer,
)


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    """These tests pin down the reference ops; GPU backends are tested against them elsewhere."""
    monkeypatch.setenv("FLASHDSA_BACKEND", "reference")


def brute_force_topk(logits, topk, starts, ends):
    """Independent oracle: sort in-range finite positions by (score desc, position asc)."""
    rows = []
    for row, start, end in zip(logits.tolist(), starts.tolist(), ends.tolist()):
        inside = [s for s in range(start, end) if abs(row[s]) != float("inf") and row[s] == row[s]]
        best = sorted(inside, key=lambda s: (-row[s], s))[:topk]
        rows.append(best + [-1] * (topk - len(best)))
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), topk)


def random_ranges(num_q, length, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, length + 1, (2, num_q), generator=g)
    starts, ends = torch.minimum(a, b).int(), torch.maximum(a, b).int()
    starts[0], ends[0] = 0, length  # one full row
    if num_q > 1:
        starts[1] = ends[1] = length // 2  # one empty row
    return starts, ends


def assert_matches_float64_topk_sets(got, logits, starts, ends):
    """Same selected values as torch.topk in float64 (so the same set up to equal scores), the
    positions above the k-th value exactly torch.topk's, in descending order, -1 after."""
    for t in range(logits.shape[0]):
        row = logits[t, starts[t] : ends[t]].double()
        k = min(got.shape[1], row.numel())
        assert (got[t, k:] == -1).all()
        if k == 0:
            continue
        expect = torch.topk(row, k)
        picked = logits[t, got[t, :k].long()].double()
        assert torch.equal(picked, expect.values)  # descending, same multiset of scores
        above = expect.values > expect.values[-1]
        assert set(got[t, :k][above].tolist()) == set((expect.indices[above] + starts[t]).tolist())


@pytest.mark.parametrize("num_q, length, topk", [(1, 1, 1), (9, 100, 16), (13, 37, 64), (4, 257, 7)])
def test_topk_equals_float64_topk_sets_in_descending_order(num_q, length, topk):
    logits = torch.randn(num_q, length, generator=torch.Generator().manual_seed(length))
    starts, ends = random_ranges(num_q, length, seed=topk)
    got = indexer_topk(logits, topk, starts, ends)
    assert got.dtype == torch.int32 and got.shape == (num_q, topk)
    assert_matches_float64_topk_sets(got, logits, starts, ends)
    assert torch.equal(got, brute_force_topk(logits, topk, starts, ends))


def test_ties_go_to_the_lower_position():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 90), generator=g).float()  # heavy ties
    logits[0] = 1.0  # all equal: the first topk positions
    starts, ends = random_ranges(6, 90, seed=1)
    got = indexer_topk(logits, 20, starts, ends)
    assert torch.equal(got, brute_force_topk(logits, 20, starts, ends))
    assert got[0].tolist() == list(range(20))


def test_non_finite_scores_are_never_selected_and_pad_with_minus_one():
    logits = torch.tensor([[1.0, float("-inf"), float("nan"), 2.0, float("inf")]])
    assert indexer_topk(logits, 4).tolist() == [[3, 0, -1, -1]]


def test_defaults_cover_the_whole_row_and_short_rows_pad():
    logits = torch.randn(3, 5)
    got = indexer_topk(logits, 8)
    assert torch.equal(got[:, :5].sort(-1).values, torch.arange(5, dtype=torch.int32).expand(3, 5))
    assert (got[:, 5:] == -1).all()
    assert indexer_topk(torch.randn(2, 0), 3).tolist() == [[-1] * 3] * 2
    assert indexer_topk(torch.randn(0, 9), 3).shape == (0, 3)


def indexer_inputs(num_q, num_keys, num_heads=3, distinct_keys=None, seed=0):
    """FP8 indexer inputs; with ``distinct_keys`` the keys repeat, so many scores tie exactly."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_keys if distinct_keys is None else distinct_keys, 128, generator=g)
    if distinct_keys is not None:
        k = k[torch.randint(0, distinct_keys, (num_keys,), generator=g)]
    q_fp8, q_scale = quantize_indexer(hadamard_transform(torch.randn(num_q, num_heads, 128, generator=g)))
    k_fp8, k_scale = quantize_indexer(hadamard_transform(k))
    return q_fp8, torch.randn(num_q, num_heads, generator=g) * q_scale, k_fp8, k_scale


@pytest.mark.parametrize("chunk", [1, 5, 16, 17, 64, 1000])
@pytest.mark.parametrize("num_q, num_keys, topk, distinct_keys", [(7, 61, 16, None), (5, 90, 9, 4), (1, 3, 16, None)])
def test_fused_topk_equals_topk_of_logits_for_any_chunk(chunk, num_q, num_keys, topk, distinct_keys):
    inputs = indexer_inputs(num_q, num_keys, distinct_keys=distinct_keys, seed=chunk)
    starts, ends = random_ranges(num_q, num_keys, seed=num_keys)
    logits = indexer_logits(*inputs, starts, ends)
    expect = indexer_topk(logits, topk, starts, ends)
    assert torch.equal(indexer_fused_topk(*inputs, starts, ends, topk, chunk=chunk), expect)
    assert torch.equal(expect, brute_force_topk(logits, topk, starts, ends))
    assert_matches_float64_topk_sets(expect, logits, starts, ends)


TOPK_OK = dict(logits=torch.randn(3, 10), topk=4, starts=torch.zeros(3, dtype=torch.int32),
               ends=torch.full((3,), 10, dtype=torch.int32))


@pytest.mark.parametrize("name, bad", [
    ("logits", torch.randn(3, 10).bfloat16()),
    ("logits", torch.randn(30)),
    ("topk", 0),
    ("topk", 4.0),
    ("topk", True),
    ("starts", torch.zeros(3)),
    ("starts", torch.zeros(4, dtype=torch.int32)),
    ("ends", torch.full((3,), 11, dtype=torch.int32)),
])
def test_indexer_topk_rejects_bad_input_naming_it(name, bad):
    with pytest.raises(ValueError, match=name):
        indexer_topk(**{**TOPK_OK, name: bad})


@pytest.mark.parametrize("name, bad", [
    ("topk", -1), ("chunk", 0), ("k_scale", torch.rand(4)), ("ends", torch.full((2,), 6, dtype=torch.int32)),
])
def test_indexer_fused_topk_rejects_bad_input_naming_it(name, bad):
    q_fp8, weights, k_fp8, k_scale = indexer_inputs(2, 5)
    args = dict(q_fp8=q_fp8, weights=weights, k_fp8=k_fp8, k_scale=k_scale, starts=torch.zeros(2, dtype=torch.int32),
                ends=torch.full((2,), 5, dtype=torch.int32), topk=2, chunk=4)
    with pytest.raises(ValueError, match=name):
        indexer_fused_topk(**{**args, name: bad})
