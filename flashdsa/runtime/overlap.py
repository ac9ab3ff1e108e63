"""Async scheduling: the host prepares step n+1 while the GPU runs step n.

With ``EngineConfig.async_scheduling`` (default on CUDA) ``LLMEngine.step()`` schedules step n+1
counting every sequence that samples in step n one token longer (``Sequence.num_pending_tokens``),
builds and uploads its inputs and launches it; the input ids that step n samples are copied on
the device from step n's sampled tokens (``TokenFill``), never through the host. The step is
sampled on the device and its tokens (and logprobs) start their copy to the host behind it
(``HostCopy``); only then does the host wait for step n's tokens and process them (stop
conditions, text, outputs) while step n+1 runs. So ``step()`` returns the previous step's
outputs, and the only wait for the GPU in a decode step is that one read-back. Under tensor
parallelism rank 0 broadcasts the sampled tokens a step takes to the other ranks over the device
group, on the stream (``parallel.steps``).

A sequence that finishes on a token of step n (EOS, a stop string or id) ran one wasted token in
step n+1: the token is dropped and the blocks are freed when step n is processed (step n+1's cache
writes are stream-ordered before any later use of them). One whose token in flight reaches
max_tokens is not scheduled again. The schedule itself can differ from the synchronous engine's
(a finished sequence still holds its place and blocks for one more step); the tokens do not.

Speculative decode steps (MTP drafts) overlap the same way. Step n verifies each sequence's draft
and the MTP layer drafts the next, on the device (``speculative.verify_on_device``); it
yields one token or two per sequence, which the host learns only when it reads step n back. So
step n+1 is built for both outcomes: the scheduler plans each such sequence as if its draft were
rejected and reserves the blocks for it accepted (``ScheduledChunk.pending_draft``), and the
device moves each sequence whose draft step n accepted one position on before the forward
(``metadata.advance``: positions, slots from the block table, context lengths); that flag, the
last token and the draft come from step n's verdict on the device (``TokenFill``: inside the CUDA
graph on the graph path, which stages only their indices). On the graph path a step of greedy
requests only is verified and drafted inside its own graph too (``DecodeGraphs.replay_verdict``:
one replay a step). Reading step n back commits its 1 or 2 tokens, counts the draft and sets
the next one. A sequence whose second token in flight might reach max_tokens waits for that
read-back instead of running past it. The blocks reserved for an accepted draft that was rejected
stay with the sequence, which fills them next (or frees them when it finishes).

A step runs synchronously instead (step n's tokens are read first, then the step runs and samples
as without async scheduling) when
- a sampling sequence has repetition / frequency / presence penalties (they count its previous
  tokens on the host) or a structured-output grammar (its bitmask needs the matcher advanced by
  the previous token),
- a chunk wants prompt logprobs, or a prompt-only request (max_tokens=0) reaches its end,
- the engine decodes speculatively and the step is not a decode step (one token plus a draft
  each) of plain requests (``speculative.plain_request``): a prefill or mixed step, a seeded
  sampled request (its host generator's draws depend on the outcome), logprobs, logit bias,
  penalties, grammars, min_tokens pending,
- its overlapped launch raised (a failing forward or sampler): the synchronous path then runs it
  again and finds the requests at fault one at a time, as without async scheduling.
A synchronous step planned behind a speculative one settles its chunks first
(``ScheduledChunk.resolve``: where each sequence stands once step n is read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from flashdsa.runtime.sampler import as_token_logprobs, logprob_tensors, penalised, sample
from flashdsa.runtime.scheduler import ScheduledChunk
from flashdsa.runtime.sequence import TokenLogprobs
from flashdsa.runtime.speculative import DeviceVerdict, device_verdict, verifiable_on_device, verify_on_device
from flashdsa.runtime.transfer import HostCopy, TokenFill, tensor_on

if TYPE_CHECKING:
    from flashdsa.runtime.model_runner import ModelRunner, StepLogits

NewTokens = tuple[list[int], list[Optional[TokenLogprobs]]]


def overlappable(chunks: list[ScheduledChunk], runner: "ModelRunner") -> bool:
    """Whether the step of ``chunks`` may run overlapped (see the module docstring for why not)."""
    if runner.speculative:
        return verifiable_on_device(chunks)
    for chunk in chunks:
        seq = chunk.seq
        if seq.wants_prompt_logprobs:
            return False
        if chunk.samples and (seq.max_tokens == 0 or seq.matcher is not None or penalised(seq)):
            return False
    return True


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens are on their way to the host.

    chunks: the chunks that sample, R of them; rows: id(seq) -> its row; tokens: (device) int64
    the token each row sampled ``[R]``, or a speculative step's packed verdict
    (``DeviceVerdict.packed``, ``[5N]``, N = ``verdict.rows`` >= R, a decode graph's bucket where
    the graph verified the step: row i's last new token at 3N + i, its next draft at 4N + i,
    whether its draft held at 2N + i); logprob_rows / num_top: the rows that asked for logprobs and how
    many alternatives each; copy: tokens, then the logprob tensors, to the host; verdict: a
    speculative step's verification (its own copy)."""

    chunks: list[ScheduledChunk]
    rows: dict[int, int]
    tokens: torch.Tensor
    logprob_rows: list[int]
    num_top: list[int]
    copy: HostCopy
    verdict: Optional[DeviceVerdict] = None

    def results(self) -> list[NewTokens]:
        """Each chunk's new tokens and their logprobs (None where not asked); waits for the copy."""
        if self.verdict is not None:
            return [(new, [None] * len(new)) for new in self.verdict.outcome[0]]
        host = self.copy.wait()
        tokens = host[0].tolist()
        logprobs: list[Optional[TokenLogprobs]] = [None] * len(tokens)
        if self.logprob_rows:
            for row, found in zip(self.logprob_rows, as_token_logprobs(host[1:], self.num_top)):
                logprobs[row] = found
        return [([token], [lp]) for token, lp in zip(tokens, logprobs)]


def launch_sampling(chunks: list[ScheduledChunk], step_logits: "StepLogits") -> InFlightStep:
    """Sample every chunk that reaches its sequence's end on the device and queue the copy of the
    tokens (and of the logprobs asked for) to the host; nothing waits for the GPU."""
    sampling = [(chunk, step_logits.sampling_row(i, chunk)) for i, chunk in enumerate(chunks) if chunk.samples]
    logits = step_logits.logits
    seqs = [chunk.seq for chunk, _ in sampling]
    if seqs:
        logits = logits.index_select(0, tensor_on([row for _, row in sampling], torch.int64, logits.device))
        tokens = sample(logits, seqs)
    else:
        tokens = torch.empty(0, dtype=torch.int64, device=logits.device)
    logprob_rows = [j for j, seq in enumerate(seqs) if seq.params.logprobs is not None]
    num_top = [seqs[j].params.logprobs for j in logprob_rows]
    found = []
    if logprob_rows:
        index = tensor_on(logprob_rows, torch.int64, logits.device)
        found = logprob_tensors(logits.index_select(0, index), tokens.index_select(0, index), num_top)
    return InFlightStep([chunk for chunk, _ in sampling], {id(seq): j for j, seq in enumerate(seqs)}, tokens,
                        logprob_rows, num_top, HostCopy([tokens, *found]))


def launch_verification(chunks: list[ScheduledChunk], step_logits: "StepLogits", runner: "ModelRunner") -> InFlightStep:
    """Verify a speculative decode step (``verifiable_on_device``) and draft the next one on the
    device, and queue the copy of the outcome to the host; nothing waits for the GPU. A step its
    decode graph verified already (``StepLogits.verdict``) only queues the copy."""
    if step_logits.verdict is not None:
        verdict = device_verdict(step_logits.verdict)
    else:
        verdict = verify_on_device(runner, step_logits.logits, [chunk.seq for chunk in chunks], with_tokens=True)
    return InFlightStep(chunks, {id(chunk.seq): j for j, chunk in enumerate(chunks)}, verdict.packed, [], [],
                        verdict.copy, verdict)


def token_fill(chunks: list[ScheduledChunk], previous: Optional[InFlightStep]) -> Optional[TokenFill]:
    """The input ids of ``chunks`` that only the device has: a chunk's last token when it is the
    one ``previous`` sampled for its sequence, and its draft when ``previous`` made it; then also
    which sequences run one position on should ``previous`` accept their draft (None when no id
    comes from the device)."""
    if previous is None:
        return None
    n = previous.verdict.rows if previous.verdict is not None else 0  # where each row's values lie in ``previous.tokens``
    last, draft, held = 3 * n, 4 * n, 2 * n
    ids: list[int] = []
    moves: list[int] = []
    for chunk in chunks:
        row = previous.rows[id(chunk.seq)] if chunk.start + chunk.num_tokens > len(chunk.seq.token_ids) else -1
        first = len(ids)
        ids += [-1] * chunk.num_run
        if row >= 0:
            ids[first + chunk.num_tokens - 1] = last + row
        if chunk.pending_draft:
            ids[first + chunk.num_tokens] = draft + row
        moves.append(held + row if chunk.pending_draft else -1)
    if max(ids, default=-1) < 0:
        return None
    return TokenFill(previous.tokens, ids, moves if max(moves) >= 0 else None)
