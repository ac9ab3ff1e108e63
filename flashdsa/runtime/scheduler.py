"""Continuous batching: which tokens of which sequences the next forward step runs.

Every step mixes decode tokens and prefill chunks under one token budget (chunked prefill).
Running sequences go first, oldest first; each gets its next chunk (1 token when decoding).
When the cache is out of blocks the newest running sequence is preempted: its blocks are freed
and it goes back to the front of the waiting queue to be recomputed later (the prefix cache
usually makes that cheap). Waiting sequences are admitted, in arrival order, while the budget,
the cap on running sequences and the free blocks allow, and never in a step that preempted.
With async scheduling a sequence's length includes the token the step in flight samples for it
(``Sequence.num_tokens``), and one whose token in flight reaches max_tokens is not scheduled.
When that step verifies a draft of the sequence (speculative decoding), it brings one token or
two: the chunk is planned for one (``ScheduledChunk.pending_draft``), gets the blocks for two, and
its last token and draft come from the device; one whose second token might reach max_tokens
waits until the step's tokens are read.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from flashdsa.runtime.block_manager import BlockManager
from flashdsa.runtime.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 2048  # tokens per forward step at most


DEVICE_TOKEN = 0  # the host's stand-in for a token only the device knows yet (async scheduling fills it in)


@dataclass
class ScheduledChunk:
    """seq runs tokens [start, start + num_tokens) of seq.token_ids this step, then ``draft``
    (speculative decoding: a guess of the token after them, verified by this step), if any.

    ``pending_draft``: the step in flight verifies a draft of seq, so the host does not know yet
    whether seq holds one token more: the chunk is planned as if that draft were rejected and
    starts one position later if it is accepted (the device moves it, ``metadata.advance``); its
    token and its draft (``DEVICE_TOKEN`` here) are the ones the step in flight produces."""

    seq: Sequence
    start: int
    num_tokens: int
    draft: Optional[int] = None
    restore_from: int = -1  # a state snapshot to copy into seq's state slot before the step (prefix hit)
    snapshot_to: int = -1  # a snapshot slot to copy seq's state slot into after the step
    pending_draft: bool = False

    @property
    def num_run(self) -> int:
        """Tokens the forward runs for this chunk (the draft included)."""
        return self.num_tokens + (self.draft is not None)

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the sequence, so the step samples a token."""
        return self.start + self.num_tokens == self.seq.num_tokens

    def resolve(self) -> None:
        """Settle a ``pending_draft`` chunk once the host has read the step in flight (the chunk
        then runs synchronously): it starts where seq's cache ends, with seq's draft."""
        if self.pending_draft:
            self.start, self.draft, self.pending_draft = self.seq.num_computed_tokens, self.seq.draft_token, False


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (first admission)
        self.prefix_hits = 0  # of which found in it

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            pending_draft = seq.num_pending_drafts > 0
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_tokens = self._cap(seq, min(remaining, budget))
            if (seq.num_pending_tokens and seq.num_output_tokens + seq.num_pending_tokens + seq.num_pending_drafts
                    >= seq.max_tokens) or (pending_draft and num_tokens >= budget):
                i += 1  # a token in flight may be its last (max_tokens), or its draft does not fit: not now
                continue
            draft = (DEVICE_TOKEN if pending_draft else seq.draft_token) if num_tokens == remaining < budget else None
            num_run = num_tokens + (draft is not None)
            while not self.block_manager.grow(seq, seq.num_computed_tokens + num_run + pending_draft):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chunks.append(self._chunk(seq, num_tokens, draft, pending_draft))
                budget -= num_run
                i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.acquire_prefix(seq)
            num_tokens = self._cap(seq, min(len(seq) - seq.num_computed_tokens, budget))
            if not self.block_manager.grow(seq, seq.num_computed_tokens + num_tokens):
                self.block_manager.free(seq)
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
                self.prefix_queries += seq.num_prompt_tokens
                self.prefix_hits += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, num_tokens))
            budget -= num_tokens
        return chunks

    def _cap(self, seq: Sequence, num_tokens: int) -> int:
        """A prefill chunk stops at the sequence's snapshot boundary (``BlockManager``), if it has one."""
        boundary = self.block_manager.snapshot_boundary(seq)
        if seq.num_computed_tokens < boundary < seq.num_computed_tokens + num_tokens:
            return boundary - seq.num_computed_tokens
        return num_tokens

    def _chunk(self, seq: Sequence, num_tokens: int, draft: Optional[int] = None,
               pending_draft: bool = False) -> ScheduledChunk:
        """seq's chunk of the step, with the state copies it needs: the snapshot its prefix hit
        restores (once), the snapshot its state is copied to where the chunk ends at the boundary."""
        chunk = ScheduledChunk(seq, seq.num_computed_tokens, num_tokens, draft, seq.restore_from,
                               pending_draft=pending_draft)
        seq.restore_from = -1
        end = seq.num_computed_tokens + num_tokens
        if end == self.block_manager.snapshot_boundary(seq) > 0:
            chunk.snapshot_to = self.block_manager.reserve_snapshot(seq)
        return chunk

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.draft_token = None  # the recompute drafts afresh
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished sequence from its queue (waiting if preempted while its last token was
        in flight) and free its blocks."""
        (self.running if seq in self.running else self.waiting).remove(seq)
        self.block_manager.free(seq)

    def abort(self, request_id: str) -> Optional[Sequence]:
        """Remove a request wherever it is, free its blocks; the sequence, or None if unknown."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.block_manager.free(seq)
                    seq.finish("abort")
                    return seq
        return None
