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
from flashdsa.runtime.transfer import to_device


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


def choose(meta: BatchMetadata, accepted: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
           context_lens: torch.Tensor) -> BatchMetadata:
    """``meta`` (device) with the positions, slot mapping (``[T]``) and context lengths (``[B]``
    int32) of each sequence b taken from the given tensors where ``accepted: [B]`` bool is true.
    Device ops only, no host sync: CUDA graphs capture it."""
    per_token = accepted[meta.seq_ids]
    return replace(meta, positions=torch.where(per_token, positions, meta.positions),
                   slot_mapping=torch.where(per_token, slot_mapping, meta.slot_mapping),
                   context_lens=torch.where(accepted, context_lens, meta.context_lens))


@dataclass
class Outcomes:
    """The two ways a step launched behind a speculative step (async scheduling) may have to run.

    The step in flight verifies drafts, so a sequence it verifies one for ends it one token longer
    when the draft is accepted, which only the device knows yet. The host builds the next step's
    ``BatchMetadata`` as if every such draft were rejected; sequence b, whose draft is
    ``accepted[rows[b]]`` (``accepted: [R]`` bool on the device, the step in flight's), then runs
    one position later: ``positions``, ``slot_mapping`` ``[T]`` int64 and ``context_lens`` ``[B]``
    int32 (CPU) hold that variant. ``rows: [B]`` int64 is -1 for a sequence whose inputs are known
    (its variant is the built one). The device picks each sequence's variant (:func:`choose`)
    before the forward; its host bounds (``context_lens_host``, ``max_context_len``) cover both."""

    rows: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    accepted: torch.Tensor

    @classmethod
    def of(cls, meta: BatchMetadata, rows: list[int], accepted: torch.Tensor,
           block_size: int = BLOCK_SIZE) -> tuple["Outcomes", BatchMetadata]:
        """The outcomes of ``meta`` (CPU, built for rejected drafts) whose sequence b waits on
        ``accepted[rows[b]]`` where ``rows[b] >= 0``, and ``meta`` with host bounds for both."""
        shift = torch.tensor([r >= 0 for r in rows], dtype=torch.int64)
        positions = meta.positions + shift[meta.seq_ids]
        lens_host = tuple(n + (r >= 0) for n, r in zip(meta.context_lens_host, rows))
        outcomes = cls(torch.tensor(rows, dtype=torch.int64), positions,
                       slots_of(meta.block_tables, meta.seq_ids, positions, block_size),
                       meta.context_lens + shift.int(), accepted)
        return outcomes, replace(meta, context_lens_host=lens_host, max_context_len=max(lens_host))

    def apply(self, meta: BatchMetadata) -> BatchMetadata:
        """``meta`` (on the device) with each sequence's variant picked on the device (an eager
        step: the variants go up in one copy)."""
        parts = [self.rows, self.positions, self.slot_mapping, self.context_lens.long()]
        up = to_device(torch.cat(parts), meta.positions.device)
        rows, positions, slots, lens = up.split([p.numel() for p in parts])
        accepted = torch.cat([self.accepted, self.accepted.new_zeros(1)])[rows]  # row -1: the False appended
        return choose(meta, accepted, positions, slots, lens.int())
