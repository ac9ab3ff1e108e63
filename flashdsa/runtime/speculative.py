"""Speculative decoding with the MTP layer: verify one drafted token per sequence.

A decode step with a draft d runs the main model over [t_{n-1}, d] (s_q = 2) and gets two rows
of logits: row 0 is the distribution p of t_n, row 1 that of t_{n+1} if t_n = d. The MTP layer
drafts greedily (its argmax), so the draft distribution q is a point mass at d and exact
rejection sampling (Leviathan et al. 2023; Chen et al. 2023) reduces to:

    greedy request:  t_n = argmax p; d accepted iff t_n = d
    sampled request: d accepted with probability p(d); otherwise t_n ~ p restricted to tokens != d

so t_n ~ p exactly: P(d) = p(d), P(x != d) = (1 - p(d)) p(x) / (1 - p(d)) = p(x). When d is accepted,
t_{n+1} is sampled from row 1 as usual (its penalties and min_tokens count d as output). p is
the sampler's own distribution (penalties, temperature, top-k/p, min-p), so the output
distribution is the main model's under the request's sampling parameters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Optional

import torch

from flashdsa.runtime.argmax import argmax_rows
from flashdsa.runtime.sampler import adjust_logits, adjusts_logits, draw, sample, sampled_logprobs, sampling_probs
from flashdsa.runtime.scheduler import ScheduledChunk
from flashdsa.runtime.sequence import Sequence, SequenceStatus, TokenLogprobs
from flashdsa.runtime.transfer import HostCopy, tensor_on

if TYPE_CHECKING:
    from flashdsa.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class SampledStep:
    """tokens[i], logprobs[i]: chunk i's new tokens (2 when its draft was accepted) and their
    logprobs (None where not asked); accepted: the chunks whose draft was accepted."""

    tokens: list[list[int]]
    logprobs: list[list[Optional[TokenLogprobs]]]
    accepted: list[int]
    num_drafts: int


def sample_step(logits: torch.Tensor, rows: list[int], chunks: list[ScheduledChunk],
                token_bitmask: Optional[torch.Tensor] = None) -> SampledStep:
    """Sample the chunks that reach their sequence's end: ``rows[i]`` is chunk i's row in
    ``logits: [N, vocab]``, a chunk with a draft has the draft's row next. A structured-output
    request falls back: its draft ran through the model but is never accepted."""
    seqs = [c.seq for c in chunks]
    first = logits[rows]
    drafts = [c.draft if c.seq.matcher is None else None for c in chunks]
    if any(d is not None for d in drafts):
        tokens, accepted = verify_drafts(first, seqs, drafts, token_bitmask)
    else:
        tokens = sample(first, seqs, token_bitmask) if seqs else torch.empty(0, dtype=torch.int64)
        accepted = torch.zeros(len(seqs), dtype=torch.bool)
    step = SampledStep([[t] for t in tokens.tolist()], [[lp] for lp in sampled_logprobs(first, tokens, seqs)],
                       [j for j, ok in enumerate(accepted.tolist()) if ok], sum(d is not None for d in drafts))
    if step.accepted:
        bonus_rows = logits[[rows[j] + 1 for j in step.accepted]]
        won = [seqs[j] for j in step.accepted]
        bonus = sample_bonus(bonus_rows, won, [drafts[j] for j in step.accepted])
        for j, token, lp in zip(step.accepted, bonus.tolist(), sampled_logprobs(bonus_rows, bonus, won)):
            step.tokens[j].append(token)
            step.logprobs[j].append(lp)
    return step


def verify_drafts(
    logits: torch.Tensor, seqs: list[Sequence], drafts: list[Optional[int]], token_bitmask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """First tokens t_n ``[N]`` int64 and whether each draft was accepted ``[N]`` bool.

    logits: [N, vocab] fp32, row i the distribution of seqs[i]'s next token; drafts[i] the token
    drafted for it, or None (no draft: the row is sampled as without speculation)."""
    logits = adjust_logits(logits, seqs, token_bitmask)
    tokens = argmax_rows(logits)
    device = logits.device
    draft = torch.tensor([-1 if d is None else d for d in drafts], device=device)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=device)
        sub = [seqs[i] for i in sampled]
        tokens[rows] = accept_or_resample(sampling_probs(logits[rows], sub), draft[rows], sub)
    return tokens, (tokens == draft) & (draft >= 0)


def accept_or_resample(probs: torch.Tensor, draft: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """t_n ``[N]`` of sampled rows with sampler distributions ``probs: [N, vocab]``: the draft
    ``draft[i]`` with probability p(d), else a draw from p without d (-1: no draft, a plain draw)."""
    has_draft = draft >= 0
    d = draft.clamp_min(0)[:, None]
    p_draft = torch.where(has_draft, probs.gather(1, d)[:, 0], 0.0)
    accept = _uniform(seqs, probs.device) < p_draft
    without_draft = torch.where(has_draft[:, None], probs.scatter(1, d, 0.0), probs)
    return torch.where(accept, draft, draw(without_draft, seqs))


def sample_bonus(logits: torch.Tensor, seqs: list[Sequence], drafts: list[int]) -> torch.Tensor:
    """Tokens t_{n+1} ``[N]`` of sequences whose drafts[i] was accepted, from logits [N, vocab]
    (row 1 of their step), with the draft counted as the sequence's latest output token."""
    for seq, d in zip(seqs, drafts):
        seq.token_ids.append(d)
    try:
        return sample(logits, seqs)
    finally:
        for seq in seqs:
            seq.token_ids.pop()


def _uniform(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """U(0, 1) per sequence, from its own generator when it set a seed."""
    u = torch.rand(len(seqs), device=device)
    for i, seq in enumerate(seqs):
        if seq.generator is not None:
            u[i] = torch.rand(1, generator=seq.generator).item()
    return u


def mtp_inputs(chunks: list[ScheduledChunk], new_tokens: dict[int, list[int]]):
    """The MTP layer's inputs for a step: the token after each flat token of the step (0 where
    unknown: after a rejected draft), the flat tokens to draft from (the last committed one of each
    sequence that sampled ``new_tokens[id(seq)]``), and for each ``(seq, its length with them)``."""
    next_ids: list[int] = []
    rows, owners = [], []
    for chunk in chunks:
        seq = chunk.seq
        ext = seq.token_ids + new_tokens.get(id(seq), [])
        first = len(next_ids)
        next_ids += [ext[p + 1] if p + 1 < len(ext) else 0 for p in range(chunk.start, chunk.start + chunk.num_run)]
        if chunk.samples and id(seq) in new_tokens:
            rows.append(first + len(ext) - 2 - chunk.start)
            owners.append((seq, len(ext)))
    return next_ids, rows, owners


def plain_request(seq: Sequence) -> bool:
    """No logprobs, nothing that reshapes its logits (``sampler.adjusts_logits``), and greedy or
    unseeded: its tokens are argmaxes or draws from the device's own generator, which the device
    can verify alone. (A seeded request draws from its host generator in an order that depends on
    whether its draft held, so it is verified once the host knows.)"""
    plain = seq.params.logprobs is None and not adjusts_logits(seq)
    return plain and (seq.params.greedy or seq.generator is None)


def verifiable_on_device(chunks: list[ScheduledChunk]) -> bool:
    """Every chunk runs one token plus a draft and samples, for a ``plain_request``: the step can
    be verified and drafted on the device alone (``verify_on_device``)."""
    return all(c.num_tokens == 1 and c.draft is not None and c.samples and plain_request(c.seq) for c in chunks)


@dataclass
class DeviceVerdict:
    """A decode step verified and drafted on the device, its copy to the host under way.

    packed: int64, what the copy reads, for N rows: ``[picks (2N) | accepted (N) | last (N) |
    drafts (N)]`` (``pack_verdict``), the ``last`` part only when asked for by an overlapped step;
    so row i's last new token is at ``3N + i``, its next draft at ``4N + i`` and whether its draft
    held at ``2N + i``, the next step's device inputs (``TokenFill``). rows: N, the step's chunks
    first; a verdict made inside a CUDA graph has its bucket's rows, padding after the chunks."""

    packed: torch.Tensor
    copy: HostCopy
    rows: int

    @property
    def picks(self) -> torch.Tensor:
        """[2N] each row's t_n, then the t_{n+1} it keeps should its draft hold."""
        return self.packed[: 2 * self.rows]

    @property
    def accepted(self) -> torch.Tensor:
        """[N] bool, whose draft held."""
        return self.packed[2 * self.rows : 3 * self.rows].bool()

    @property
    def tokens(self) -> Optional[torch.Tensor]:
        """[2N] int64 each row's last new token, then its next draft (None unless asked for)."""
        n = self.rows
        return self.packed[3 * n :] if self.packed.numel() == 5 * n else None

    @cached_property
    def outcome(self) -> tuple[list[list[int]], list[int]]:
        """Each row's new tokens (1, or 2 where its draft held) and its next draft; waits for the copy."""
        values = self.copy.wait()[0].tolist()
        n = self.rows
        return [values[2 * i : 2 * i + 1 + values[2 * n + i]] for i in range(n)], values[len(values) - n :]


def pack_verdict(picks: torch.Tensor, drafts: torch.Tensor, mtp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 with_tokens: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The packed verdict (``DeviceVerdict.packed``) of a step whose N sequences each ran [t, d]:
    ``picks: [2N]`` int64 each one's t_n and the t_{n+1} it keeps should its draft hold, ``drafts:
    [N]`` the drafts it ran, ``mtp(next_ids, rows)`` the MTP layer's logits ``[N, vocab]`` (the
    token after each flat token, the flat token each sequence drafts from). A draft holds when
    d = t_n; the token after flat token 2i is t_n, after 2i + 1 it is t_{n+1} (if the draft held);
    each sequence drafts from its last committed token, flat token ``2i + held``. Device ops only,
    no host sync: a CUDA graph captures it (``DecodeGraphs.replay_verdict``)."""
    accepted = picks[0::2] == drafts
    rows = torch.arange(accepted.numel(), device=picks.device) * 2 + accepted
    next_drafts = argmax_rows(mtp(picks, rows))
    last = [picks.index_select(0, rows)] if with_tokens else []  # flat token ``rows[i]`` is row i's last new one
    return torch.cat([picks, accepted.long(), *last, next_drafts], out=out)


def verify_on_device(runner: "ModelRunner", logits: torch.Tensor, seqs: list[Sequence],
                     with_tokens: bool = False) -> DeviceVerdict:
    """Queue the verification of a ``verifiable_on_device`` step of ``seqs``, flat tokens [t_0, d_0,
    t_1, d_1, ...] and logits rows in the same order. Greedy: t_n = argmax of a chunk's first row,
    t_{n+1} = argmax of its second. Sampled: t_n by rejection sampling of the draft (module
    docstring), t_{n+1} drawn from the second row whatever the outcome (kept only if the draft
    holds: the draw does not bias which). The MTP layer's next draft is drafted from the same
    device tensors (``pack_verdict``: its inputs never visit the host), so the step reads the
    device once instead of four times. ``with_tokens`` (async scheduling) also packs the next
    step's input ids (one gather into the copy's buffer). The buffer is the runner's
    ``verdict_buffer`` where it has one (a CUDA graph of the next step reads it in place), else a
    new tensor. Nothing here waits for the GPU. (An all-greedy step the decode graphs run does all
    of this inside their graph instead: ``ModelRunner.run(..., verify=True)``.)"""
    picks = argmax_rows(logits)  # [2N]: t_n and, if the draft holds, t_{n+1} of each chunk
    drafts = runner.last_input_ids()[1::2]  # the step's odd input ids, on the device: no host copy to wait for
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if sampled:
        rows = tensor_on(sampled, torch.int64, logits.device)
        sub = [seqs[i] for i in sampled]
        pairs = logits.view(-1, 2, logits.shape[1]).index_select(0, rows)  # [S, 2, vocab]
        first = accept_or_resample(sampling_probs(pairs[:, 0], sub), drafts.index_select(0, rows), sub)
        second = draw(sampling_probs(pairs[:, 1], sub), sub)
        picks.view(-1, 2).index_copy_(0, rows, torch.stack([first, second], dim=1))
    n = len(seqs)
    packed = pack_verdict(picks, drafts, runner.draft, with_tokens, runner.verdict_buffer((5 if with_tokens else 4) * n))
    return DeviceVerdict(packed, HostCopy([packed]), n)


def device_verdict(packed: torch.Tensor) -> DeviceVerdict:
    """The verdict a decode graph packed (``with_tokens``: ``[5N]``, its bucket's N rows), its copy
    to the host queued."""
    return DeviceVerdict(packed, HostCopy([packed]), packed.numel() // 5)


class Speculation:
    """The engine's side of speculative decoding: verify each step's drafts (on the device when
    it can), count them, and set every sequence's next draft."""

    def __init__(self, runner: "ModelRunner", max_model_len: int) -> None:
        self.runner = runner
        self.max_model_len = max_model_len
        self.num_draft_tokens = 0  # drafts verified (vLLM's spec_decode_num_draft_tokens)
        self.num_accepted_tokens = 0  # of which accepted

    def verify_on_device(self, chunks: list[ScheduledChunk], sampling: list, logits: torch.Tensor) -> Optional[list]:
        """A decode step of plain requests only (every chunk samples, with a draft): verify and
        draft on the device in one read-back (``verify_on_device``): each chunk's (new tokens, their
        logprobs). None when the step does not qualify or that fails (the engine's general path
        then runs)."""
        if not (len(sampling) == len(chunks) and verifiable_on_device(chunks)):
            return None
        try:
            tokens, drafts = verify_on_device(self.runner, logits, [c.seq for c in chunks]).outcome
        except Exception:
            logger.exception("verifying %d drafts on the device failed; using the general path", len(chunks))
            return None
        return [self.settle(chunk.seq, new, draft) for chunk, new, draft in zip(chunks, tokens, drafts)]

    def settle(self, seq: Sequence, new: list[int], draft: int) -> tuple[list[int], list[None]]:
        """Count seq's draft verified on the device (``new``: its new tokens, 2 when the draft held)
        and set its next draft: its (new tokens, their logprobs: none asked)."""
        self._count(1, [seq] if len(new) == 2 else [])
        self._set_draft(seq, len(seq) + len(new), draft)
        return new, [None] * len(new)

    def sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor, rows: list[int],
               token_bitmask: Optional[torch.Tensor]) -> Optional[list]:
        """Each chunk's (new tokens, their logprobs), its draft verified (``sample_step``); None
        when no chunk has a draft or verifying fails (every draft then counts as rejected)."""
        if all(c.draft is None for c in chunks):
            return None
        try:
            step = sample_step(logits, rows, chunks, token_bitmask)
        except Exception:
            logger.exception("verifying %d drafts failed; sampling without them", len(chunks))
            return None
        self._count(step.num_drafts, [chunks[j].seq for j in step.accepted])
        return list(zip(step.tokens, step.logprobs))

    def draft(self, chunks: list[ScheduledChunk], new_tokens: dict[int, list[int]]) -> None:
        """Run the MTP layer over the step and set the next draft of every sequence that sampled
        (none where the draft's position would pass max_model_len). Drafts only save time: if the
        MTP layer fails, the sequences go on without one."""
        next_ids, rows, owners = mtp_inputs(chunks, new_tokens)
        try:
            ids, flat = torch.tensor(next_ids, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)
            drafts = argmax_rows(self.runner.draft(ids, flat)).tolist()
        except Exception:
            logger.exception("the MTP layer failed; this step drafts nothing")
            drafts = [None] * len(owners)
        for (seq, length), draft in zip(owners, drafts):
            self._set_draft(seq, length, draft)

    def _count(self, num_drafts: int, accepted: list[Sequence]) -> None:
        """Count a step's verified drafts; an accepted draft is in the cache already (unless its
        sequence was preempted while the step was in flight, async scheduling: it recomputes)."""
        for seq in accepted:
            seq.num_computed_tokens += seq.status is SequenceStatus.RUNNING
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += len(accepted)

    def _set_draft(self, seq: Sequence, length: int, draft: Optional[int]) -> None:
        """seq's next draft, once it holds ``length`` tokens: none where its position would pass
        max_model_len, or where seq was preempted meanwhile (its recompute drafts afresh)."""
        running = seq.status is SequenceStatus.RUNNING
        seq.draft_token = draft if length < self.max_model_len and running else None
