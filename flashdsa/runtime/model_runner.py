"""Turns a scheduled step into model inputs (token ids + BatchMetadata) and runs the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdsa.runtime.cache.allocator import slot_mapping
from flashdsa.runtime.metadata import BatchMetadata
from flashdsa.runtime.scheduler import ScheduledChunk


@dataclass
class StepLogits:
    """logits: [N, vocab] fp32; chunk i's rows are logits[row_start[i] : row_start[i] + num_rows[i]].

    A chunk that samples has its sampling row last; a chunk that wants prompt logprobs has one
    row per token it ran (row j predicts the token after position chunk.start + j).
    """

    logits: torch.Tensor
    row_start: list[int]
    num_rows: list[int]


def build_metadata(chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, BatchMetadata, list[int], list[int]]:
    """Flat input ids [T] int64 and the step's BatchMetadata (CPU), plus each chunk's logits rows."""
    ids, positions, seq_ids, slots, logits_indices = [], [], [], [], []
    starts, context_lens, row_start, num_rows = [0], [], [], []
    for b, chunk in enumerate(chunks):
        seq, end = chunk.seq, chunk.start + chunk.num_tokens
        pos = torch.arange(chunk.start, end, dtype=torch.int64)
        ids.append(torch.tensor(seq.token_ids[chunk.start : end], dtype=torch.int64))
        positions.append(pos)
        seq_ids.append(torch.full((chunk.num_tokens,), b, dtype=torch.int64))
        slots.append(slot_mapping(seq.block_table, pos))
        row_start.append(len(logits_indices))
        if seq.wants_prompt_logprobs:
            logits_indices.extend(range(starts[-1], starts[-1] + chunk.num_tokens))
        elif chunk.samples:
            logits_indices.append(starts[-1] + chunk.num_tokens - 1)
        num_rows.append(len(logits_indices) - row_start[-1])
        starts.append(starts[-1] + chunk.num_tokens)
        context_lens.append(end)
    width = max(len(c.seq.block_table) for c in chunks)
    tables = [c.seq.block_table + [-1] * (width - len(c.seq.block_table)) for c in chunks]
    meta = BatchMetadata(
        positions=torch.cat(positions),
        seq_ids=torch.cat(seq_ids),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        slot_mapping=torch.cat(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )
    return torch.cat(ids), meta, row_start, num_rows


class ModelRunner:
    """Owns the model and its paged caches (MLA latent + indexer keys, one block table)."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.caches = model.allocate_caches(num_blocks)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> StepLogits:
        input_ids, meta, row_start, num_rows = build_metadata(chunks)
        logits = self.model(input_ids.to(self.device), meta.to(self.device), self.caches)
        return StepLogits(logits.float(), row_start, num_rows)
