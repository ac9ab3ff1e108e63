"""Decode steps replayed as CUDA graphs, one per batch-size bucket.

A decode step (every sequence runs one token and samples it) has the same kernels whatever the
batch holds, so the model runner captures the forward once per bucket of batch sizes and replays
it: one host-to-device copy of the step's inputs and one graph launch instead of thousands of
kernel launches. A step of B sequences replays the smallest bucket >= B; the rows past B are
padding that writes no cache slot (slot -1) and reads block 0 (their outputs are dropped).

Inputs live in one static int64 buffer, ``[ids | positions | slots | fill | next_ids | rows |
context_lens | state_slots | moves | block table]``, the per-token fields ``max_batch * q`` long (q
tokens per sequence: 1, or 2 with speculative decoding), the per-sequence ones ``max_batch`` and
the table ``max_batch x max_blocks``, so the copy of a step is one prefix of it. With async
scheduling a step's inputs are partly on the device only: ``fill`` says which input ids the graph
takes from ``source``, a static device buffer holding what the step in flight left there (a
speculative step's verdict is written into it, ``ModelRunner.verdict_buffer``; a plain step's
sampled tokens are copied in), and ``moves`` (speculative graphs) where it reads whether a
sequence's draft held: the host builds the step as if every draft were rejected and the graph moves
each accepted sequence one position on (``metadata.advance``: positions, slots from the block
table, context lengths). The graph writes those into the static inputs in place, so the MTP
layer's graph and the caller see the step as it ran; nothing of it runs outside the graph. Padding
rows of a model with per-sequence state (DeepSeek-V4) use state slot ``max_batch``, the one the
runner allocates beyond the block manager's. The graph itself unpacks the buffer into the model's
``BatchMetadata``. The host stages a step in one of two pinned buffers, in turn: with async
scheduling it writes step n+1's inputs while step n's copy may still be queued, and the engine has
waited for step n-1's tokens (queued after the copy from the other buffer) by then. A buffer's
padding rows are rewritten only where a larger batch wrote over them since. The paged
indexer scores ``max_model_len`` columns (fixed at
capture); each row's top-k scans only its own context.

Speculative graphs come in three sets a bucket: the forward (model at s_q = 2, logits and hidden
states), the MTP layer's draft over its hidden states, and a verdict graph for an all-greedy
step: the forward, the greedy verification and the MTP layer's draft in one graph
(``speculative.pack_verdict``), its packed verdict written into ``source``. Async scheduling runs
an all-greedy decode step as that one replay: no logits leave it, no kernel runs beside it, and
the next step's graph reads the verdict in place. A step with a sampled request replays the
forward and the draft graph around the host-driven verification.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from flashdsa.runtime.argmax import argmax_rows
from flashdsa.runtime.checks import trusted_values
from flashdsa.runtime.metadata import BatchMetadata, advance
from flashdsa.runtime.speculative import pack_verdict
from flashdsa.runtime.transfer import TokenFill, flags_at, gather_or_keep

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (and ``max_batch`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode forwards of ``model`` over ``caches`` for batches up to ``max_batch``.

    With ``speculative`` every sequence runs two tokens (its last one and the MTP layer's draft),
    the forward also returns the hidden states, a second graph per bucket runs the MTP layer
    over them (:meth:`replay_draft`) and a third verifies an all-greedy step and drafts the next
    one in the same replay as its forward (:meth:`replay_verdict`)."""

    def __init__(self, model: torch.nn.Module, caches, max_batch: int, max_model_len: int, device: torch.device,
                 speculative: bool = False):
        self.model, self.caches, self.device, self.speculative = model, caches, device, speculative
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.q = 2 if speculative else 1  # tokens per sequence
        self.block_size = caches.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        mq = max_batch * self.q
        # per-token fields (mq long), then per-sequence fields (max_batch long), then the block table;
        # the MTP layer's own inputs (next_ids, rows) side by side, so its host path uploads them alone
        sizes = {"ids": mq, "positions": mq, "slots": mq, "fill": mq, "next_ids": mq, "rows": max_batch,
                 "context_lens": max_batch, "state_slots": max_batch}
        if speculative:
            sizes["moves"] = max_batch
        # what the step in flight left on the device: its sampled tokens [R], or its verdict [5R]
        self.source = torch.zeros(max_batch * (5 if speculative else 1), dtype=torch.int64, device=device)
        self.offsets, offset = {}, 0
        for name, size in sizes.items():
            self.offsets[name] = offset
            offset += size
        self.table_offset = offset
        size = self.table_offset + max_batch * self.max_blocks
        self.stagings = [torch.zeros(size, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.staging = self.stagings[0]  # the buffer of the latest replay
        self.padded_from = [max_batch, max_batch]  # per staging buffer: its rows from here on are padding
        self.inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.draft_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.draft_outputs: dict[int, torch.Tensor] = {}
        self.verdict_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.buckets = batch_buckets(max_batch)
        self.batch = 0  # sequences of the last replay

    def can_run(self, batch: int, max_context_len: int) -> bool:
        return batch <= self.max_batch and max_context_len <= self.max_model_len

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool; logs time and memory (the
        pool's: the allocator's free cache is emptied before and after, as a capture empties it
        anyway, so the loader's freed temporaries do not count against the graphs)."""
        torch.cuda.empty_cache()
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        self._pad(0)
        self.inputs.copy_(self.staging)
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.buckets):
            self._forward(batch)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            self.graphs[batch] = graph
            if self.speculative:
                self._draft_forward(batch)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.draft_outputs[batch] = self._draft_forward(batch)
                self.draft_graphs[batch] = graph
                self._verdict_forward(batch)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._verdict_forward(batch)
                self.verdict_graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        logger.info("captured %d decode CUDA graphs (batch %s, %d tokens each%s) in %.1f s, %.2f GiB of graph memory",
                    len(self.graphs), self.buckets, self.q,
                    ", with the MTP layer's and the greedy verdict's" if self.speculative else "",
                    time.perf_counter() - start, (torch.cuda.memory_reserved(self.device) - before) / 2**30)

    def replay(self, input_ids: torch.Tensor, meta: BatchMetadata, fill: Optional[TokenFill] = None):
        """Logits ``[B * q, vocab]`` fp32 (speculative: and the hidden states ``[B * q, hidden]``) of
        a decode step whose host-side inputs are ``input_ids: [B * q]`` and ``meta`` (CPU tensors);
        the graph takes the ids and moves of ``fill`` from the device itself. Valid until the next
        replay."""
        bucket = self._stage(input_ids, meta, fill)
        self.graphs[bucket].replay()
        n, out = self.batch * self.q, self.outputs[bucket]
        return (out[0][:n], out[1][:n]) if self.speculative else out[:n]

    def replay_verdict(self, input_ids: torch.Tensor, meta: BatchMetadata,
                       fill: Optional[TokenFill] = None) -> torch.Tensor:
        """The packed verdict (``speculative.DeviceVerdict.packed`` with the next step's input ids,
        ``[5 * bucket]`` int64: the step's sequences' rows first, then the bucket's padding rows)
        of an all-greedy speculative decode step given as to :meth:`replay`: its forward, greedy
        verification and the MTP layer's next drafts in one replay, the verdict written into
        ``source``, where the next step's graph reads it. Valid until the next replay."""
        bucket = self._stage(input_ids, meta, fill)
        self.verdict_graphs[bucket].replay()
        return self.source[: 5 * bucket]

    def _stage(self, input_ids: torch.Tensor, meta: BatchMetadata, fill: Optional[TokenFill]) -> int:
        """Write a step's host-side inputs into the next staging buffer and queue their upload; the
        bucket to replay."""
        batch = meta.num_seqs
        bucket = next(b for b in self.buckets if b >= batch)
        self.staging = self.stagings[1] if self.staging is self.stagings[0] else self.stagings[0]
        s = self.staging
        fields = [("ids", input_ids), ("positions", meta.positions), ("slots", meta.slot_mapping),
                  ("context_lens", meta.context_lens), ("state_slots", meta.state_slots)]
        for name, field in fields:
            if field is not None:
                s[self.offsets[name] : self.offsets[name] + field.numel()] = field
        self._stage_fill(fill, batch)
        table = s[self.table_offset : self.table_offset + bucket * self.max_blocks].view(bucket, self.max_blocks)
        table[:batch].fill_(-1)
        table[:batch, : meta.block_tables.shape[1]] = meta.block_tables
        self._pad(batch)
        used = self.table_offset + bucket * self.max_blocks
        self.inputs[:used].copy_(s[:used], non_blocking=True)
        self.batch = batch
        return bucket

    def _stage_fill(self, fill: Optional[TokenFill], batch: int) -> None:
        """Stage which input ids (``fill``) and accepted drafts (``moves``) the graph reads from
        ``source`` (none without ``fill``: -1). A source other than ``self.source`` itself (a plain
        step's sampled tokens) is copied into it on the device, stream-ordered before the graph."""
        s, n = self.staging, batch * self.q
        fill_at, moves_at = self.offsets["fill"], self.offsets.get("moves", 0)
        if fill is None:
            s[fill_at : fill_at + n] = -1
            if self.speculative:
                s[moves_at : moves_at + batch] = -1
            return
        if fill.source.data_ptr() != self.source.data_ptr():
            self.source[: fill.source.numel()].copy_(fill.source)
        moves = (fill.moves or [-1] * batch) if self.speculative else []
        index = torch.tensor(fill.ids + moves, dtype=torch.int64)  # one tensor of both lists, two staging writes
        s[fill_at : fill_at + n] = index[:n]
        if moves:
            s[moves_at : moves_at + batch] = index[n:]

    def replay_draft(self, next_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[len(rows), vocab]`` of the MTP layer after the last :meth:`replay`:
        ``next_ids: [B * q]`` the token after each of its tokens, ``rows: [B]`` one flat token per
        sequence. On the host they travel in one copy (of their two fields alone: the step's other
        inputs stay as its graph left them); on the device they are copied in place
        (stream-ordered after the step, no host round trip)."""
        bucket = next(b for b in self.buckets if b >= self.batch)
        if next_ids.is_cuda:
            self._field("next_ids", next_ids.numel()).copy_(next_ids)
            self._field("rows", rows.numel()).copy_(rows)
        else:
            s, first, end = self.staging, self.offsets["next_ids"], self.offsets["rows"] + self.max_batch
            s[first : first + next_ids.numel()] = next_ids
            s[self.offsets["rows"] : self.offsets["rows"] + rows.numel()] = rows
            self.inputs[first:end].copy_(s[first:end], non_blocking=True)
        self.draft_graphs[bucket].replay()
        return self.draft_outputs[bucket][: rows.numel()]

    def _pad(self, first: int) -> None:
        """Make the current staging buffer's sequences from ``first`` on padding. A buffer's padding
        rows keep their values until a larger batch writes over them, so a run of steps of one batch
        size writes them once, not every step (host time on the step's critical path)."""
        i = 0 if self.staging is self.stagings[0] else 1
        if first < self.padded_from[i]:
            self._fill_padding(first, self.padded_from[i])
        self.padded_from[i] = first

    def _fill_padding(self, first: int, last: int) -> None:
        """Sequences [first, last): token 0 at positions 0.. of a q-token context in block 0,
        writing nothing, taking nothing from ``source``; their draft row is their first token."""
        s, q = self.staging, self.q
        for name, value in (("ids", 0), ("positions", None), ("slots", -1), ("fill", -1), ("next_ids", 0)):
            field = s[self.offsets[name] + first * q : self.offsets[name] + last * q]
            field.copy_(torch.arange(q).repeat(last - first) if value is None else torch.full_like(field, value))
        s[self.offsets["context_lens"] + first : self.offsets["context_lens"] + last] = q
        s[self.offsets["rows"] + first : self.offsets["rows"] + last] = torch.arange(first, last) * q
        s[self.offsets["state_slots"] + first : self.offsets["state_slots"] + last] = self.max_batch
        if self.speculative:
            s[self.offsets["moves"] + first : self.offsets["moves"] + last] = -1
        s[self.table_offset + first * self.max_blocks : self.table_offset + last * self.max_blocks] = 0

    def input_ids(self, length: int) -> torch.Tensor:
        """The device copy of the last replay's first ``length`` input ids."""
        return self._field("ids", length)

    def _field(self, name: str, length: int) -> torch.Tensor:
        return self.inputs[self.offsets[name] : self.offsets[name] + length]

    def _meta(self, batch: int) -> BatchMetadata:
        """The static inputs' first ``batch`` sequences as the model's BatchMetadata (device tensors)."""
        q, n = self.q, batch * self.q
        table = self.inputs[self.table_offset : self.table_offset + batch * self.max_blocks].view(batch, self.max_blocks)
        seq_ids = torch.arange(batch, device=self.device)  # each op here is a node of every replay
        return BatchMetadata(
            positions=self._field("positions", n),
            seq_ids=seq_ids if q == 1 else seq_ids.repeat_interleave(q),
            query_start_loc=torch.arange(0, n + 1, q, device=self.device, dtype=torch.int32),
            context_lens=self._field("context_lens", batch).to(torch.int32), slot_mapping=self._field("slots", n),
            block_tables=table.to(torch.int32), logits_indices=torch.arange(n, device=self.device),
            query_lens=(q,) * batch, context_lens_host=(self.max_model_len,) * batch,
            max_context_len=self.max_model_len, state_slots=self._field("state_slots", batch),
        )

    def _take_from_source(self, batch: int) -> BatchMetadata:
        """The metadata of the first ``batch`` sequences as the step runs, after writing what they
        take from ``source`` into the static inputs, in place: their device-only input ids and,
        speculative, the positions, slots and context lengths of those whose draft the step before
        accepted (``metadata.advance``). Part of the forward's graph, so the MTP layer's graph and
        :meth:`input_ids` see the step as it ran."""
        n = batch * self.q
        ids = self._field("ids", n)
        ids.copy_(gather_or_keep(self.source, self._field("fill", n), ids))
        meta = self._meta(batch)
        if not self.speculative:
            return meta
        meta = advance(meta, flags_at(self.source, self._field("moves", batch)), self.block_size)
        for name, value in (("positions", meta.positions), ("slots", meta.slot_mapping),
                            ("context_lens", meta.context_lens)):
            self._field(name, value.numel()).copy_(value)
        return meta

    def _forward(self, batch: int):
        """The model's decode forward over the first ``batch`` sequences of the static inputs."""
        meta = self._take_from_source(batch)
        kwargs = {"return_hidden": True} if self.speculative else {}
        with trusted_values():
            return self.model(self._field("ids", batch * self.q), meta, self.caches, **kwargs)

    def _draft_forward(self, batch: int) -> torch.Tensor:
        """The MTP layer over the same tokens, from the captured forward's hidden states."""
        return self._mtp(batch, self.outputs[batch][1], self._field("next_ids", batch * self.q),
                         self._field("rows", batch))

    def _mtp(self, batch: int, hidden: torch.Tensor, next_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The MTP layer's logits ``[batch, vocab]`` at flat tokens ``rows`` of the step the static
        inputs hold (as it ran), from its hidden states; ``next_ids: [batch * q]`` the token after
        each flat token."""
        meta = self._meta(batch)
        meta.logits_indices = rows
        with trusted_values():
            return self.model.mtp_forward(next_ids, hidden, meta, self.caches)

    def _verdict_forward(self, batch: int) -> None:
        """The forward of an all-greedy step, its verification and the next drafts, the verdict
        packed into ``source`` (``speculative.pack_verdict``)."""
        logits, hidden = self._forward(batch)
        drafts = self._field("ids", 2 * batch)[1::2]
        pack_verdict(argmax_rows(logits), drafts, lambda next_ids, rows: self._mtp(batch, hidden, next_ids, rows),
                     True, self.source[: 5 * batch])
