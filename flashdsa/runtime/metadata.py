"""Per-step batch metadata handed explicitly from the engine to every attention layer.

One forward runs a flat batch of T tokens from B sequences, each a prefill chunk or decode
tokens. The model reads only this object (no globals), so a reader sees what each layer needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def to(self, device: torch.device) -> "BatchMetadata":
        return BatchMetadata(**{k: v.to(device) for k, v in vars(self).items()})
