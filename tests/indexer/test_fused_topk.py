"""The Triton fused top-k's row groups (host arithmetic, no kernel runs): they cover the rows in
order, each fits the scratch budget, each is as large as fits (so a causal prompt's triangle is
cut tight), and the row bounds they come from are non-decreasing and at most the keys. The
kernels themselves are checked against the reference in test_triton_indexer.py."""

import pytest
import torch

from flashdsa.runtime.indexer.triton.fused_topk import _groups, _row_bounds
from flashdsa.runtime.indexer.triton.topk import SCRATCH_BYTES, SCRATCH_COLS

ROW_CELLS = 2048 + SCRATCH_COLS.value  # a row's selection scratch at topk 2048, in 4-byte cells


def assert_tight_groups(bounds, first, last, row_cells, cells):
    groups = list(_groups(bounds, first, last, row_cells, cells))
    assert [r0 for r0, _ in groups] == [first] + [r1 for _, r1 in groups[:-1]] and groups[-1][1] == last

    def cost(r0, r1):
        return (r1 - r0) * max(int(bounds[r1 - 1]), row_cells)

    for r0, r1 in groups:
        assert r1 - r0 == 1 or cost(r0, r1) <= cells  # fits (a lone row always goes)
        assert r1 == last or cost(r0, r1 + 1) > cells  # and the next row would not
    return groups


@pytest.mark.parametrize("seed", range(5))
def test_groups_cover_the_rows_in_order_each_fitting_and_as_large_as_fits(seed):
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 400, (1,), generator=g))
    ends = torch.randint(0, 3000, (rows,), generator=g)  # any order: the running max bounds them
    bounds = _row_bounds(ends.tolist(), rows, 2500)
    assert (bounds[1:] >= bounds[:-1]).all() and (bounds <= 2500).all() and (bounds >= ends.clamp(max=2500)).all()
    first = int(torch.randint(0, rows, (1,), generator=g))
    cells = int(torch.randint(100, 20000, (1,), generator=g))
    assert_tight_groups(bounds, first, rows, int(torch.randint(1, 700, (1,), generator=g)), cells)


@pytest.mark.parametrize("prompt, groups", [(4096, 1), (16384, 3), (65536, 34)])
def test_a_causal_prompt_takes_few_groups_at_the_default_budget(prompt, groups):
    bounds = _row_bounds(torch.arange(1, prompt + 1), prompt, prompt)
    assert len(assert_tight_groups(bounds, 0, prompt, ROW_CELLS, SCRATCH_BYTES // 4)) == groups


def test_without_bounds_every_row_may_reach_the_last_key():
    assert _row_bounds(None, 3, 70).tolist() == [70, 70, 70]
    assert _row_bounds([5, 2, 90, 0], 4, 70).tolist() == [5, 5, 70, 70]
    assert _row_bounds([], 0, 70).shape == (0,)
