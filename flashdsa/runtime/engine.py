"""The engine: requests in, one scheduled forward step at a time, token and text deltas out.

`LLMEngine.step()` schedules a batch (continuous batching, chunked prefill), runs the model,
samples the sequences whose chunk reached their end, checks the stop conditions
(``runtime/outputs.py``) and returns a `RequestOutput` per request that advanced. With async
scheduling (default on CUDA) the host schedules and launches the next step before it reads this
one's tokens, and ``step()`` returns the previous step's outputs (``runtime/overlap.py``, which
lists the steps that still run synchronously). Errors stay with their request: a failing forward
is retried one request at a time, a failing sampler row, prompt-logprob pass or detokenizer fails
its request alone, and the engine keeps going. With ``speculative_tokens=1`` a decode step also
verifies each sequence's draft and the MTP layer drafts the next (``runtime/speculative.py``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from flashdsa.runtime.block_manager import BlockManager
from flashdsa.runtime.engine_config import EngineConfig, plan_num_blocks
from flashdsa.runtime.model_runner import ModelRunner, StepLogits, state_slots
from flashdsa.runtime.outputs import OutputProcessor
from flashdsa.runtime.overlap import (InFlightStep, NewTokens, launch_sampling, launch_verification, overlappable,
                                     token_fill)
from flashdsa.runtime.sampler import sample_each, token_logprobs
from flashdsa.runtime.speculative import Speculation
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from flashdsa.runtime.sequence import BLOCK_SIZE, RequestOutput, Sequence
from flashdsa.runtime.structured import Grammars

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: Optional[EngineConfig] = None) -> None:
        self.config = config or EngineConfig()
        if self.config.speculative_tokens and not getattr(model, "supports_speculative", True):
            raise ValueError(f"speculative_tokens: {type(model).__name__} does not support speculative decoding yet; "
                             f"use 0")
        if self.config.speculative_tokens and not getattr(model, "has_mtp", False):
            raise ValueError("speculative_tokens=1 needs the model's multi-token-prediction layer: load it with "
                             "load_model(..., mtp=True) from a checkpoint that has one")
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        max_len = self.config.model_len(model.config.max_position_embeddings)
        self.num_blocks = plan_num_blocks(model, self.config, self.device, max_len)
        if max_len > self.num_blocks * BLOCK_SIZE:
            logger.warning("max_model_len %d exceeds the cache (%d blocks); using %d", max_len,
                           self.num_blocks, self.num_blocks * BLOCK_SIZE)
            max_len = self.num_blocks * BLOCK_SIZE
        self.max_model_len = max_len
        prefix_caching = self.config.enable_prefix_caching
        self.block_manager = BlockManager(self.num_blocks, prefix_caching,
                                          *state_slots(model, self.config.max_num_seqs, prefix_caching))
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens), self.block_manager
        )
        self.runner = ModelRunner(model, self.num_blocks, self.device, self.config.max_num_seqs, max_len,
                                  self.config.enforce_eager, speculative=self.config.speculative_tokens > 0,
                                  prefix_caching=prefix_caching)
        self.speculation = Speculation(self.runner, max_len) if self.config.speculative_tokens else None
        self.grammars = Grammars(tokenizer, self.vocab_size)
        self.output_processor = OutputProcessor(tokenizer, self.scheduler, max_len)
        async_scheduling = self.config.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if async_scheduling is None else async_scheduling
        self.in_flight: Optional[InFlightStep] = None  # the launched step whose tokens are not read yet
        self.num_aborted = 0  # requests dropped unfinished (client gone)
        self.num_failed = 0  # requests ended by an error

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """ValueError if the request cannot run here; else its max output tokens. No side effects."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not all(t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if not all(t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        needed = 1 if params.max_tokens is None else params.max_tokens
        if n + needed > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + needed} tokens ({n} in the prompt, {needed} for the completion)."
            )
        return self.max_model_len - n if params.max_tokens is None else params.max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; ValueError if its prompt or length do not fit the model."""
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.check_request(prompt_token_ids, params)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        seq = Sequence(request_id, list(prompt_token_ids), params, max_tokens, eos)
        if params.structured_outputs is not None:
            seq.matcher = self.grammars.matcher(params.structured_outputs)
        self.output_processor.add(seq)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks (unknown ids are ignored)."""
        if self.scheduler.abort(request_id) is not None:
            self.num_aborted += 1
        self.output_processor.forget(request_id)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every unfinished request with an error (for a step that failed outside any request)."""
        self.in_flight = None
        return [self._fail(seq, message) for seq in [*self.scheduler.running, *self.scheduler.waiting]]

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified (vLLM's spec_decode_num_draft_tokens)."""
        return self.speculation.num_draft_tokens if self.speculation else 0

    @property
    def num_accepted_tokens(self) -> int:
        """Drafts accepted."""
        return self.speculation.num_accepted_tokens if self.speculation else 0

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests that advanced (with async scheduling: in the
        step before, which this one overlaps)."""
        chunks = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        if chunks and self.async_scheduling and overlappable(chunks, self.runner):
            self.in_flight = self._launch(chunks, previous)
            if self.in_flight is not None:
                chunks = []
        outputs = self._complete(previous) if previous is not None else []
        chunks = [c for c in chunks if not c.seq.is_finished]  # previous's tokens ended them
        for chunk in chunks:
            chunk.resolve()  # a sequence whose draft previous verified: where it stands now
        return outputs + (self._run(chunks) if chunks else [])

    def _launch(self, chunks: list[ScheduledChunk], previous: Optional[InFlightStep]) -> Optional[InFlightStep]:
        """Run the step of ``chunks`` and sample it on the device, its input ids that ``previous``
        sampled taken from the device; count its tokens as computed, its samples and drafts as pending.
        None (nothing counted) if the forward or the sampler raised: the step then runs synchronously."""
        try:
            greedy = self.speculation is not None and all(chunk.seq.params.greedy for chunk in chunks)
            step_logits = self.runner.run(chunks, token_fill(chunks, previous), verify=greedy)
            if self.speculation:
                in_flight = launch_verification(chunks, step_logits, self.runner)
            else:
                in_flight = launch_sampling(chunks, step_logits)
        except Exception:
            logger.exception("overlapped step of %d requests failed; running it synchronously", len(chunks))
            return None
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.register_computed(chunk.seq)
        for chunk in in_flight.chunks:
            chunk.seq.num_pending_tokens += 1
            chunk.seq.num_pending_drafts += chunk.draft is not None
        return in_flight

    def _complete(self, step: InFlightStep) -> list[RequestOutput]:
        """Wait for the tokens ``step`` sampled and append them (with speculation: 1 or 2, the
        drafts counted and the next ones set); a sequence that finished meanwhile (its wasted
        tokens) or was aborted gets none. A failed read-back fails the step's requests."""
        try:
            results = step.results()
            drafts = step.verdict.outcome[1] if step.verdict is not None else None
        except Exception as exc:
            logger.exception("reading a step's tokens failed")
            results, drafts = [exc] * len(step.chunks), None
        outputs = []
        for j, (chunk, result) in enumerate(zip(step.chunks, results)):
            seq = chunk.seq
            seq.num_pending_tokens -= 1
            seq.num_pending_drafts -= chunk.draft is not None
            if seq.is_finished:
                continue
            if drafts is not None:
                result = self.speculation.settle(seq, result[0], drafts[j])
            outputs.append(self._commit(seq, result))
        return outputs

    def _run(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """Run, sample and process one step synchronously (every input id on the host)."""
        try:
            step_logits = self.runner.run(chunks)
        except Exception:  # find the request(s) at fault: run each alone (rewriting the same slots is harmless)
            logger.exception("forward step failed; running its %d requests one at a time", len(chunks))
        else:
            return self._process(chunks, step_logits)
        outputs = []
        for chunk in chunks:
            try:
                step_logits = self.runner.run([chunk])
            except Exception as exc:
                outputs.append(self._fail(chunk.seq, f"forward failed: {exc}"))
                continue
            outputs += self._process([chunk], step_logits)
        return outputs

    def _process(self, chunks: list[ScheduledChunk], step_logits: StepLogits) -> list[RequestOutput]:
        """Advance the chunks that ran: prompt logprobs, computed tokens, then one token for each
        sequence whose chunk reached its end (two when its draft is accepted; a prompt-only request
        finishes there instead); with speculation the MTP layer then drafts the next tokens."""
        outputs, sampling = [], []
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            try:
                if seq.wants_prompt_logprobs:
                    self._add_prompt_logprobs(chunk, step_logits, i)
            except Exception as exc:
                outputs.append(self._fail(seq, f"prompt logprobs failed: {exc}"))
                continue
            seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.register_computed(seq)
            if chunk.samples and seq.max_tokens == 0:
                seq.finish("length")
                outputs.append(self.output_processor.output(seq, [], "", []))
            elif chunk.samples:
                sampling.append((chunk, step_logits.sampling_row(i, chunk)))
        spec = self.speculation
        results = spec.verify_on_device(chunks, sampling, step_logits.logits) if spec else None
        if results is None:
            results = self._sample([c for c, _ in sampling], step_logits.logits, [row for _, row in sampling])
            if spec:
                spec.draft(chunks, {id(c.seq): r[0] for (c, _), r in zip(sampling, results) if not isinstance(r, Exception)})
        return outputs + [self._commit(chunk.seq, result) for (chunk, _), result in zip(sampling, results)]

    def _commit(self, seq: Sequence, result: NewTokens | Exception) -> RequestOutput:
        """Append a step's new tokens to seq (stop conditions, text): its output, or its failure."""
        if isinstance(result, Exception):
            return self._fail(seq, f"sampling failed: {result}")
        try:
            return self.output_processor.append_tokens(seq, *result)
        except Exception as exc:
            logger.exception("request %s failed", seq.request_id)
            return self._fail(seq, str(exc))

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor, rows: list[int]) -> list:
        """Per chunk: (its new tokens, their logprobs), or the Exception that failed its request.
        Drafts are verified when there are any; should that fail, every draft counts as rejected
        and the rows are sampled as without speculation (still the model's distribution)."""
        if not chunks:
            return []
        seqs = [c.seq for c in chunks]
        bitmask = self.grammars.bitmask([seq.matcher for seq in seqs], self.device)
        verified = self.speculation.sample(chunks, logits, rows, bitmask) if self.speculation else None
        if verified is not None:
            return verified
        return [r if isinstance(r, Exception) else ([r[0]], [r[1]]) for r in sample_each(logits[rows], seqs, bitmask)]

    def _add_prompt_logprobs(self, chunk: ScheduledChunk, step_logits: StepLogits, i: int) -> None:
        seq = chunk.seq
        count = min(chunk.num_tokens, seq.num_prompt_tokens - 1 - chunk.start)
        if chunk.start == 0:
            seq.prompt_logprobs = [None]
        if count <= 0:
            return
        first = step_logits.row_start[i]
        targets = torch.tensor(seq.token_ids[chunk.start + 1 : chunk.start + 1 + count], device=self.device)
        found = token_logprobs(step_logits.logits[first : first + count], targets, [seq.params.prompt_logprobs] * count)
        seq.prompt_logprobs.extend(found)

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        self.scheduler.abort(seq.request_id)
        self.output_processor.forget(seq.request_id)
        seq.finish("error")
        self.num_failed += 1
        return RequestOutput(seq.request_id, [], "", True, seq.num_prompt_tokens, seq.num_output_tokens,
                             finish_reason="error", error=message)
