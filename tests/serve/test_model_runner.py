"""The step's BatchMetadata, checked field by field against a per-sequence computation."""

import random

import torch

from flashdsa.runtime.cache.allocator import slot_mapping
from flashdsa.runtime.model_runner import build_metadata
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.scheduler import ScheduledChunk
from flashdsa.runtime.sequence import Sequence


def test_metadata_matches_per_sequence_slots_and_ranges():
    rng = random.Random(0)
    chunks = []
    for i, (length, start, n) in enumerate([(300, 0, 100), (70, 69, 1), (5, 0, 5), (200, 128, 72), (1, 0, 1)]):
        seq = Sequence(f"s{i}", [rng.randrange(500) for _ in range(length)],
                       SamplingParams(prompt_logprobs=1 if i == 3 else None), max_tokens=8)
        seq.block_table = rng.sample(range(100), -(-(start + n) // 64))
        chunks.append(ScheduledChunk(seq, start, n))
    ids, meta, row_start, num_rows = build_metadata(chunks)
    qsl = meta.query_start_loc.tolist()
    assert qsl == [0, 100, 101, 106, 178, 179]
    for b, c in enumerate(chunks):
        lo, hi = qsl[b], qsl[b + 1]
        positions = torch.arange(c.start, c.start + c.num_tokens)
        assert ids[lo:hi].tolist() == c.seq.token_ids[c.start : c.start + c.num_tokens]
        assert torch.equal(meta.positions[lo:hi], positions)
        assert (meta.seq_ids[lo:hi] == b).all()
        assert torch.equal(meta.slot_mapping[lo:hi], slot_mapping(c.seq.block_table, positions))
        table = meta.block_tables[b]
        assert table[: len(c.seq.block_table)].tolist() == c.seq.block_table and (table[len(c.seq.block_table):] == -1).all()
        assert meta.context_lens[b] == c.start + c.num_tokens
    # chunk 0 is a partial prefill (no logits), chunk 3 wants prompt logprobs (a row per token)
    assert num_rows == [0, 1, 1, 72, 1]
    assert meta.logits_indices.tolist() == [100, 105] + list(range(106, 178)) + [178]
    assert row_start == [0, 0, 1, 2, 74]
    assert meta.positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.dtype == meta.context_lens.dtype == meta.block_tables.dtype == torch.int32
