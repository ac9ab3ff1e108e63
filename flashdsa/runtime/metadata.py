"""Per-step batch metadata handed explicitly from the engine to every attention layer.

One forward runs a flat batch of T tokens from B sequences, each a prefill chunk or decode
tokens. The model reads only this object (no globals), so a reader sees what each layer needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdsa.runtime.cache.layout import BLOCK_SIZE


@dataclass
class BatchMetadata:
    """positions: [T] int64, position of each token in its sequence.
    seq_ids: [T] int64, which of the B sequences each token belongs to (0..B-1), sequences
        contiguous and in order.
    query_start_loc: [B + 1] int32, token range of sequence b is [qsl[b], qsl[b+1]).
    context_lens: [B] int32, tokens of sequence b in the cache after this step's writes.
    slot_mapping: [T] int64, cache slot (block_id * block_size + offset) each token writes.
    block_tables: [B, max_blocks] int32, physical block ids of each sequence, -1 padded.
    logits_indices: [N] int64, tokens whose logits the model returns (usually each sequence's last).
    """

    positions: torch.Tensor
    seq_ids: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @classmethod
    def for_step(
        cls, starts: list[int], counts: list[int], block_tables: torch.Tensor, logits_indices: torch.Tensor,
        block_size: int = BLOCK_SIZE,
    ) -> "BatchMetadata":
        """Metadata (CPU) of a step in which sequence b runs ``counts[b]`` tokens from position
        ``starts[b]``, its blocks in row b of ``block_tables: [B, max_blocks]`` int32."""
        counts_t, starts_t = torch.tensor(counts), torch.tensor(starts)
        query_start_loc = torch.zeros(len(counts) + 1, dtype=torch.int32)
        query_start_loc[1:] = counts_t.cumsum(0)
        seq_ids = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
        positions = torch.arange(int(query_start_loc[-1])) + (starts_t - query_start_loc[:-1])[seq_ids]
        tables = block_tables.to(torch.int32)
        slots = tables[seq_ids, positions // block_size].long() * block_size + positions % block_size
        return cls(
            positions=positions,
            seq_ids=seq_ids,
            query_start_loc=query_start_loc,
            context_lens=(starts_t + counts_t).int(),
            slot_mapping=slots,
            block_tables=tables,
            logits_indices=logits_indices,
        )

    def to(self, device: torch.device) -> "BatchMetadata":
        return BatchMetadata(**{k: v.to(device) for k, v in vars(self).items()})
