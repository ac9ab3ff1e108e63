"""KeyRanges.end_bounds: the host bounds of each query's key end that size the fused top-k's
row groups hold for V3.2 (exact: one key per token) and for V4's CSA (one key per 4 tokens)."""

import pytest
import torch

from flashdsa.models.deepseek_v4_compressor import visible_entries
from flashdsa.models.indexer import KeyRanges
from flashdsa.runtime.metadata import BatchMetadata


def step(starts, counts):
    tables = torch.arange(len(counts) * 128, dtype=torch.int32).view(len(counts), 128)
    return BatchMetadata.for_step(starts, counts, tables, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("starts, counts", [([0, 100, 7], [9, 1, 300]), ([0], [1]), ([4095], [2])])
def test_v32_bounds_are_each_query_s_end(starts, counts):
    meta = step(starts, counts)
    keys = KeyRanges.of_tokens(meta)
    assert torch.equal(torch.cat([keys.end_bounds(b) for b in range(len(counts))]), keys.ends.long())


@pytest.mark.parametrize("ratio", [4, 128])
def test_csa_bounds_hold_every_query_s_visible_entries_and_meet_the_last(ratio):
    meta = step([0, 3, 129, 1000], [2, 700, 5, 4])
    visible = visible_entries(meta.positions, ratio)
    keys = KeyRanges(meta.context_lens // ratio, tuple(n // ratio for n in meta.context_lens_host), visible.int(),
                     meta.max_context_len // ratio, meta.query_lens, meta.block_tables, tokens_per_key=ratio)
    first = 0
    for b, n in enumerate(meta.query_lens):
        bounds, ends = keys.end_bounds(b), visible[first:first + n]
        assert (bounds >= ends).all() and bounds[-1] == ends[-1] == keys.lengths_host[b]
        first += n
