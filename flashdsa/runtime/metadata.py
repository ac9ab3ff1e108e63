"""Per-step batch metadata handed explicitly from the engine to every attention layer.

One forward runs a flat batch of T tokens from B sequences, each a prefill chunk or decode
tokens. The model reads only this object (no globals), so a reader sees what each layer needs.
The host keeps the per-sequence counts as Python ints (``query_lens``, ``context_lens_host``), so
the forward never reads a device value back: it stays free of host syncs and capturable in a
CUDA graph. The tensors travel to the device in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

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
    query_lens: host ints, tokens of each sequence in this step.
    context_lens_host: host ints, the same as ``context_lens``.
    max_context_len: host int >= every context length: the width of the paged indexer's scores
        (a CUDA graph fixes it at capture, so it may exceed the batch's longest context).
    state_slots: [B] int64, each sequence's state slot (``BlockManager``; models with
        per-sequence state only), or None: sequence b in slot b.
    """

    positions: torch.Tensor
    seq_ids: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    query_lens: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    max_context_len: int
    state_slots: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @classmethod
    def for_step(
        cls, starts: list[int], counts: list[int], block_tables: torch.Tensor, logits_indices: torch.Tensor,
        block_size: int = BLOCK_SIZE, state_slots: list[int] | None = None,
    ) -> "BatchMetadata":
        """Metadata (CPU) of a step in which sequence b runs ``counts[b]`` tokens from position
        ``starts[b]``, its blocks in row b of ``block_tables: [B, max_blocks]`` int32 (and its
        state in slot ``state_slots[b]``)."""
        counts_t, starts_t = torch.tensor(counts), torch.tensor(starts)
        query_start_loc = torch.zeros(len(counts) + 1, dtype=torch.int32)
        query_start_loc[1:] = counts_t.cumsum(0)
        # A list, not torch.repeat_interleave: on the CPU that takes ~6 ms for 128 sequences.
        seq_ids = torch.tensor([b for b, n in enumerate(counts) for _ in range(n)], dtype=torch.int64)
        positions = torch.arange(int(query_start_loc[-1])) + (starts_t - query_start_loc[:-1])[seq_ids]
        tables = block_tables.to(torch.int32)
        return cls(
            positions=positions,
            seq_ids=seq_ids,
            query_start_loc=query_start_loc,
            context_lens=(starts_t + counts_t).int(),
            slot_mapping=slots_of(tables, seq_ids, positions, block_size),
            block_tables=tables,
            logits_indices=logits_indices,
            query_lens=tuple(counts),
            context_lens_host=tuple(s + c for s, c in zip(starts, counts)),
            max_context_len=max((s + c for s, c in zip(starts, counts)), default=0),
            state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.int64),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def sequence_ranges(self) -> list[tuple[int, int, int]]:
        """``(first token, end token, context length)`` of each sequence in the flat batch (host ints)."""
        out, first = [], 0
        for n, length in zip(self.query_lens, self.context_lens_host):
            out.append((first, first + n, length))
            first += n
        return out

    def with_room(self, may_move: list[bool]) -> "BatchMetadata":
        """This metadata with host bounds (``context_lens_host``, ``max_context_len``) that also
        cover each sequence b one position on where ``may_move[b]`` (its draft in flight may hold:
        the device then moves it, :func:`advance`)."""
        lens = tuple(n + m for n, m in zip(self.context_lens_host, may_move))
        return replace(self, context_lens_host=lens, max_context_len=max(lens))

    def to(self, device: torch.device) -> "BatchMetadata":
        """A copy on ``device``: the tensors packed into one int64 buffer and moved in one transfer."""
        tensors = self.tensors()
        if all(t.device == device for t in tensors.values()):
            return self
        flat = torch.cat([t.reshape(-1).long() for t in tensors.values()])
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        moved, offset = {}, 0
        for name, t in tensors.items():
            moved[name] = flat[offset : offset + t.numel()].view(t.shape).to(t.dtype)
            offset += t.numel()
        return BatchMetadata(**{**vars(self), **moved})


def slots_of(block_tables: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
             block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Cache slot ``[T]`` int64 of each token: its sequence's (``seq_ids``) block holding its position."""
    return block_tables[seq_ids, positions // block_size].long() * block_size + positions % block_size


def advance(meta: BatchMetadata, moved: torch.Tensor, block_size: int = BLOCK_SIZE) -> BatchMetadata:
    """``meta`` (device) with each sequence b where ``moved: [B]`` bool is true one position on:
    its positions and context length + 1, its tokens' slots read from its block table (the slot of
    position p is ``block_tables[b, p // block_size] * block_size + p % block_size``, so a token at
    a block's end moves to the next block's first slot). Async scheduling behind a speculative step
    builds the step as if every draft in flight were rejected; ``moved`` says whose was accepted
    (``transfer.TokenFill``). The other sequences' slots stay (a CUDA graph's padding rows write
    nothing). Device ops only, no host sync: CUDA graphs capture it."""
    per_token = moved[meta.seq_ids]
    positions = meta.positions + per_token
    slots = torch.where(per_token, slots_of(meta.block_tables, meta.seq_ids, positions, block_size), meta.slot_mapping)
    return replace(meta, positions=positions, slot_mapping=slots, context_lens=meta.context_lens + moved.int())
