"""A deterministic stand-in for DeepseekV32ForCausalLM.

The fake writes each token id into its own paged "cache" (one int per slot) and computes the
next-token logits of a position from the context it reads back through the block table, so a
wrong slot mapping, block table or prefix-cache hit changes the text.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flashdsa.runtime.cache.allocator import slot_mapping
from flashdsa.runtime.metadata import BatchMetadata


def context_logits(context: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The fake's logits [vocab] fp32 after the tokens ``context`` [n] int64."""
    weights = torch.arange(1, context.numel() + 1, dtype=torch.int64)
    key = int(((context + 1) * weights * 1_000_003).sum()) % (2**31)
    return 4 * torch.randn(vocab_size, generator=torch.Generator().manual_seed(key))


class FakeModel(torch.nn.Module):
    def __init__(self, vocab_size: int, max_position_embeddings: int = 1024) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
        self.mode = "reference"
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the engine a device to read

    def cache_bytes_per_block(self) -> int:
        return 64 * 8

    def allocate_caches(self, num_blocks: int) -> torch.Tensor:
        return torch.full((num_blocks * 64,), -1, dtype=torch.int64)

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, caches: torch.Tensor) -> torch.Tensor:
        caches[meta.slot_mapping] = input_ids
        rows = []
        for t in meta.logits_indices.tolist():
            table = meta.block_tables[int(meta.seq_ids[t])]
            slots = slot_mapping(table[table >= 0], torch.arange(int(meta.positions[t]) + 1))
            rows.append(context_logits(caches[slots], self.config.vocab_size))
        return torch.stack(rows) if rows else torch.empty(0, self.config.vocab_size)


POISON = 99


class FailsOnPoison(FakeModel):
    """Fails every forward whose input ids hold POISON (as the model sees them: after the device
    fills in the tokens of an overlapped step)."""

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, caches: torch.Tensor) -> torch.Tensor:
        if (input_ids == POISON).any():
            raise RuntimeError("poisoned input")
        return super().forward(input_ids, meta, caches)


def reference_greedy(prompt_ids: list[int], vocab_size: int, max_tokens: int, eos: int) -> list[int]:
    """What greedy decoding of the fake must produce, computed without any cache."""
    ids = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(context_logits(torch.tensor(ids), vocab_size).argmax())
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out
