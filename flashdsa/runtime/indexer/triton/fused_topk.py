"""Indexer score + top-k of the prefill in Triton, without ever holding the ``[T, S]`` logits.

Rows whose key range fits are scored whole and selected once: consecutive rows go in groups
whose scores ``[rows, width]`` fp32 fit the scratch budget, ``width`` the group's widest end (so
a causal prompt's triangle is cut at group granularity), one ragged logits launch and one
selection (four launches) per group: a 16K prompt is 3 groups, a 64K one 34 (budget 256 MB).

Rows too wide for a group of ``MIN_ROWS`` (past 512K keys at that budget) walk the keys
``chunk`` at a time instead: each chunk's scores are written next to the running top-k and the
selection rewrites it in place, a selection and a sort per chunk, so O(rows * (topk + chunk)).

Group widths come from host bounds on the row ends (``max_ends``; without them every row may
reach the last key), so nothing is read back from the device. A bound below a row's true end
costs that row its keys past its group's width; no kernel reads or writes outside its buffers.
Memory: scores, candidate lists and per-row selection scratch each take at most the budget.
"""

from __future__ import annotations

import bisect
from typing import Iterator, Optional, Sequence, Union

import torch

from flashdsa.runtime.indexer.triton.logits import ragged_logits_into
from flashdsa.runtime.indexer.triton.topk import BLOCK, SCRATCH_BYTES, SCRATCH_COLS, _check_topk, _Selection

MIN_ROWS = 128  # rows of the narrowest group scored whole: the finish pass runs one program per row
NUM_WARPS = 8  # of the selection's passes 1-3


def _row_bounds(max_ends: Union[Sequence[int], torch.Tensor, None], num_q: int, num_keys: int) -> torch.Tensor:
    """Host int64 [T]: a non-decreasing bound of each row's end (a running max, at most the keys)."""
    if max_ends is None:
        return torch.full((num_q,), num_keys, dtype=torch.int64)
    bounds = torch.as_tensor(max_ends, dtype=torch.int64).clamp(0, num_keys)
    return bounds.cummax(0).values if num_q else bounds


def _groups(bounds: torch.Tensor, first: int, last: int, row_cells: int, cells: int) -> Iterator[tuple[int, int]]:
    """Consecutive row groups ``(r0, r1)`` covering rows [first, last): each as many rows as fit
    ``rows * max(width, row_cells) <= cells`` with width ``bounds[r1 - 1]`` (at least one row)."""
    r0 = first
    while r0 < last:
        def cost(r1: int) -> int:
            return (r1 - r0) * max(int(bounds[r1 - 1]), row_cells)

        r1 = r0 + max(1, bisect.bisect_right(range(r0 + 1, last + 1), cells, key=cost))
        yield r0, r1
        r0 = r1


def _whole_rows(selection: _Selection, scores: torch.Tensor, inputs, starts, ends, topk: int, out: torch.Tensor,
                r0: int, r1: int, width: int, sort: bool) -> None:
    """Rows [r0, r1): score keys [0, width) into ``scores`` (flat) and select once per row."""
    if width == 0:
        out[r0:r1] = -1
        return
    rows = slice(r0, r1)
    vals = scores[:(r1 - r0) * width].view(r1 - r0, width)
    q_fp8, weights, k_fp8, k_scale = inputs
    ragged_logits_into(vals, q_fp8[rows], weights[rows], k_fp8, k_scale, starts[rows], ends[rows])
    selection.run(vals, topk, width, out[rows], ranges=(starts[rows], ends[rows]), sort=sort)


def _chunked_rows(inputs, starts, ends, topk: int, chunk: int, out: torch.Tensor, bounds: torch.Tensor,
                  first: int, budget: int, k_pad: int) -> None:
    """Rows [first, T): a running top-k merged with one chunk of scores at a time (always sorted)."""
    q_fp8, weights, k_fp8, k_scale = inputs
    width = topk + chunk
    row_cells = max(width, k_pad + SCRATCH_COLS.value)
    group = max(1, min(out.shape[0] - first, budget // (4 * row_cells)))
    scores = torch.empty(group, width, dtype=torch.float32, device=out.device)
    selection = _Selection(group, group * width, k_pad, out.device, None, BLOCK, NUM_WARPS)
    for r0 in range(first, out.shape[0], group):
        rows = slice(r0, min(r0 + group, out.shape[0]))
        n = rows.stop - r0
        best_pos = out[rows]
        best_pos.fill_(-1)
        scores[:n, :topk] = float("-inf")
        for s0 in range(0, int(bounds[rows.stop - 1]), chunk):
            c = min(chunk, k_fp8.shape[0] - s0)
            ragged_logits_into(scores[:n, topk:topk + c], q_fp8[rows], weights[rows], k_fp8, k_scale,
                               starts[rows], ends[rows], col0=s0)
            selection.run(scores[:n], topk, topk + c, best_pos, prefix=(best_pos, topk), pos_base=s0,
                          out_vals=scores[:n])


def indexer_fused_topk(q_fp8, weights, k_fp8, k_scale, starts, ends, topk: int, chunk: int, sorted: bool = True,
                       max_ends: Union[Sequence[int], torch.Tensor, None] = None, *, budget: int = SCRATCH_BYTES,
                       whole_keys: Optional[int] = None) -> torch.Tensor:
    """Top-k of the indexer logits (arguments of ``indexer_logits``): ``[T, topk]`` int32, -1 padded;
    ``sorted=False`` leaves the rows scored whole by ascending position (the rest stay sorted).
    ``max_ends``: host [T] bounds of ``ends`` that size the groups. Knobs (tests, benchmarks):
    ``budget`` bytes of scores (and again of candidates) per group; ``whole_keys``: rows whose
    bound exceeds it take the chunked merge (default ``budget / (4 * min(MIN_ROWS, T))``)."""
    k_pad = _check_topk(topk)
    num_q, num_keys, device = q_fp8.shape[0], k_fp8.shape[0], q_fp8.device
    out = torch.empty(num_q, topk, dtype=torch.int32, device=device)
    if num_q == 0:
        return out
    inputs = tuple(t.contiguous() for t in (q_fp8, weights, k_fp8, k_scale))
    bounds = _row_bounds(max_ends, num_q, num_keys)
    cells, row_cells = budget // 4, k_pad + SCRATCH_COLS.value
    whole_keys = cells // min(MIN_ROWS, num_q) if whole_keys is None else whole_keys
    split = int(torch.searchsorted(bounds, whole_keys, right=True))  # rows [0, split) are scored whole
    groups = list(_groups(bounds, 0, split, row_cells, cells))
    if groups:
        widths = [int(bounds[r1 - 1]) for _, r1 in groups]
        most = max((r1 - r0) * w for (r0, r1), w in zip(groups, widths))
        scores = torch.empty(most, dtype=torch.float32, device=device)
        selection = _Selection(max(r1 - r0 for r0, r1 in groups), most, k_pad, device, None, BLOCK, NUM_WARPS)
        for (r0, r1), width in zip(groups, widths):
            _whole_rows(selection, scores, inputs, starts, ends, topk, out, r0, r1, width, sorted)
        del scores, selection  # the chunked rows allocate their own scratch
    if split < num_q:
        _chunked_rows(inputs, starts, ends, topk, chunk, out, bounds, split, budget, k_pad)
    return out
