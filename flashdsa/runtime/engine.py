"""The engine: requests in, one scheduled forward step at a time, token and text deltas out.

`LLMEngine.step()` schedules a batch (continuous batching, chunked prefill), runs the model,
samples the sequences whose chunk reached their end, checks the stop conditions and returns a
`RequestOutput` per request that advanced. Errors stay with their request: a failing forward is
retried one request at a time, a failing sampler row, prompt-logprob pass or detokenizer fails
its request alone, and the engine keeps going. With ``speculative_tokens=1`` a decode step also
verifies each sequence's draft and the MTP layer drafts the next (``runtime/speculative.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from flashdsa.runtime.block_manager import BlockManager
from flashdsa.runtime.checks import check
from flashdsa.runtime.detokenizer import Detokenizer
from flashdsa.runtime.model_runner import ModelRunner, StepLogits, num_state_slots
from flashdsa.runtime.sampler import sample_each, token_logprobs
from flashdsa.runtime.speculative import mtp_inputs, plain_greedy, sample_step, verify_greedy_on_device
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from flashdsa.runtime.sequence import BLOCK_SIZE, RequestOutput, Sequence, TokenLogprobs
from flashdsa.runtime.structured import Grammars, advance

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    num_blocks: Optional[int] = None  # default: cache_fraction of the device memory (CUDA)
    cache_fraction: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    speculative_tokens: int = 0  # 1: draft one token per step with the MTP layer (speculative decoding)

    def __post_init__(self) -> None:
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        check(self.max_model_len is None or self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        check(self.num_blocks is None or self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        check(0 < self.cache_fraction <= 1, f"cache_fraction must be in (0, 1], got {self.cache_fraction}")
        check(self.speculative_tokens in (0, 1), f"speculative_tokens must be 0 or 1, got {self.speculative_tokens}")

    def model_len(self, positions: int) -> int:
        """Tokens a sequence may hold on a model of ``positions`` positions: max_model_len, by
        default all of them. ValueError if max_model_len asks for more."""
        check(self.max_model_len is None or self.max_model_len <= positions,
              f"max_model_len {self.max_model_len} exceeds the model's {positions} positions "
              f"(max_position_embeddings): pass at most {positions}")
        return self.max_model_len or positions


def plan_num_blocks(model: torch.nn.Module, config: EngineConfig, device: torch.device, max_model_len: int) -> int:
    """Blocks for the caches: as configured, else a fraction of free device memory, never more
    than the running sequences could fill."""
    ceiling = config.max_num_seqs * -(-max_model_len // BLOCK_SIZE)
    if config.num_blocks is not None:
        return config.num_blocks
    if device.type != "cuda":
        return min(ceiling, 1024)
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1 - config.cache_fraction) * total
    if num_state_slots(model, config.max_num_seqs):
        budget -= (config.max_num_seqs + 1) * model.state_bytes_per_slot()  # + 1: see ModelRunner
    return max(1, min(ceiling, int(budget // model.cache_bytes_per_block())))


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: Optional[EngineConfig] = None) -> None:
        self.config = config or EngineConfig()
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
        prefix_caching = self.config.enable_prefix_caching and getattr(model, "supports_prefix_caching", True)
        if self.config.enable_prefix_caching and not prefix_caching:
            logger.info("prefix caching is off: %s keeps per-sequence state that cached blocks cannot restore",
                        type(model).__name__)
        self.block_manager = BlockManager(self.num_blocks, prefix_caching,
                                          num_state_slots(model, self.config.max_num_seqs))
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens), self.block_manager
        )
        self.runner = ModelRunner(model, self.num_blocks, self.device, self.config.max_num_seqs, max_len,
                                  self.config.enforce_eager, speculative=self.config.speculative_tokens > 0)
        self.num_draft_tokens = 0  # drafts verified (vLLM's spec_decode_num_draft_tokens)
        self.num_accepted_tokens = 0  # of which accepted
        self.grammars = Grammars(tokenizer, self.vocab_size)
        self.detokenizers: dict[str, Detokenizer] = {}
        self.last_token_time: dict[str, float] = {}
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
        if request_id in self.detokenizers:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.check_request(prompt_token_ids, params)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        seq = Sequence(request_id, list(prompt_token_ids), params, max_tokens, eos)
        if params.structured_outputs is not None:
            seq.matcher = self.grammars.matcher(params.structured_outputs)
        self.detokenizers[request_id] = Detokenizer(
            self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks (unknown ids are ignored)."""
        if self.scheduler.abort(request_id) is not None:
            self.num_aborted += 1
        self._forget(request_id)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every unfinished request with an error (for a step that failed outside any request)."""
        return [self._fail(seq, message) for seq in [*self.scheduler.running, *self.scheduler.waiting]]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
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
                outputs.append(self._output(seq, [], "", []))
            elif chunk.samples:  # its last token's row (a draft's row follows it)
                sampling.append((chunk, step_logits.row_start[i] + step_logits.num_rows[i] - 1 - (chunk.draft is not None)))
        results = self._verify_on_device(chunks, sampling, step_logits.logits)
        if results is None:
            results = self._sample([c for c, _ in sampling], step_logits.logits, [row for _, row in sampling])
            if self.runner.speculative:
                self._draft(chunks, {id(c.seq): r[0] for (c, _), r in zip(sampling, results) if not isinstance(r, Exception)})
        for (chunk, _), result in zip(sampling, results):
            seq = chunk.seq
            if isinstance(result, Exception):
                outputs.append(self._fail(seq, f"sampling failed: {result}"))
                continue
            try:
                outputs.append(self._append_tokens(seq, *result))
            except Exception as exc:
                logger.exception("request %s failed", seq.request_id)
                outputs.append(self._fail(seq, str(exc)))
        return outputs

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor, rows: list[int]) -> list:
        """Per chunk: (its new tokens, their logprobs), or the Exception that failed its request.
        Drafts are verified when there are any; should that fail, every draft counts as rejected
        and the rows are sampled as without speculation (still the model's distribution)."""
        if not chunks:
            return []
        seqs = [c.seq for c in chunks]
        bitmask = self.grammars.bitmask([seq.matcher for seq in seqs], self.device)
        if any(c.draft is not None for c in chunks):
            try:
                step = sample_step(logits, rows, chunks, bitmask)
            except Exception:
                logger.exception("verifying %d drafts failed; sampling without them", len(chunks))
            else:
                self._count_drafts(step.num_drafts, [seqs[j] for j in step.accepted])
                return list(zip(step.tokens, step.logprobs))
        return [r if isinstance(r, Exception) else ([r[0]], [r[1]]) for r in sample_each(logits[rows], seqs, bitmask)]

    def _verify_on_device(self, chunks: list[ScheduledChunk], sampling: list, logits: torch.Tensor) -> Optional[list]:
        """A speculative decode step of plain greedy requests only (every chunk samples, with a
        draft): verify and draft on the device in one read-back (``verify_greedy_on_device``).
        None when the step does not qualify or that fails (the general path then runs)."""
        if not (self.runner.speculative and len(sampling) == len(chunks)
                and all(c.num_tokens == 1 and c.draft is not None and plain_greedy(c.seq) for c in chunks)):
            return None
        try:
            tokens, drafts = verify_greedy_on_device(self.runner, logits, chunks)
        except Exception:
            logger.exception("verifying %d drafts on the device failed; using the general path", len(chunks))
            return None
        self._count_drafts(len(chunks), [c.seq for c, new in zip(chunks, tokens) if len(new) == 2])
        for chunk, new, draft in zip(chunks, tokens, drafts):
            self._set_draft(chunk.seq, len(chunk.seq) + len(new), draft)
        return [(new, [None] * len(new)) for new in tokens]

    def _count_drafts(self, num_drafts: int, accepted: list[Sequence]) -> None:
        """Count a step's verified drafts; an accepted draft is in the cache already."""
        for seq in accepted:
            seq.num_computed_tokens += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += len(accepted)

    def _set_draft(self, seq: Sequence, length: int, draft: Optional[int]) -> None:
        """seq's next draft, once it holds ``length`` tokens: none where its position would pass max_model_len."""
        seq.draft_token = draft if length < self.max_model_len else None

    def _draft(self, chunks: list[ScheduledChunk], new_tokens: dict[int, list[int]]) -> None:
        """Run the MTP layer over the step and set the next draft of every sequence that sampled
        (none where the draft's position would pass max_model_len). Drafts only save time: if the
        MTP layer fails, the sequences go on without one."""
        next_ids, rows, owners = mtp_inputs(chunks, new_tokens)
        try:
            ids, flat = torch.tensor(next_ids, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)
            drafts = self.runner.draft(ids, flat).argmax(dim=1).tolist()
        except Exception:
            logger.exception("the MTP layer failed; this step drafts nothing")
            drafts = [None] * len(owners)
        for (seq, length), draft in zip(owners, drafts):
            self._set_draft(seq, length, draft)

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

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[Optional[TokenLogprobs]]) -> RequestOutput:
        """Append the step's tokens, up to the one that finishes the sequence, as one output."""
        text, kept = "", 0
        for token in tokens:
            text += self._append_token(seq, token)
            kept += 1
            if seq.is_finished:
                break
        return self._output(seq, tokens[:kept], text, [lp for lp in logprobs[:kept] if lp is not None])

    def _append_token(self, seq: Sequence, token: int) -> str:
        """Append one token and apply the stop conditions; the text it adds."""
        seq.append_token(token)
        params = seq.params
        grammar_ended = seq.matcher is not None and advance(seq.matcher, token)
        stoppable = seq.num_output_tokens >= params.min_tokens  # no stop condition applies before min_tokens
        if stoppable and token == seq.eos_token_id and not params.ignore_eos:
            seq.finish("stop")
        elif stoppable and token in seq.stop_token_ids:
            seq.finish("stop", token)
        elif grammar_ended:
            seq.finish("stop")
        elif seq.num_output_tokens >= seq.max_tokens or len(seq) >= self.max_model_len:
            seq.finish("length")
        detok = self.detokenizers[seq.request_id]
        if not (seq.is_finished and seq.finish_reason == "stop"):
            stop = detok.add_token(token, final=seq.is_finished, find_stop=stoppable)
            if stop is not None:
                seq.finish("stop", stop)
        return detok.delta(seq.is_finished)

    def _output(self, seq: Sequence, token_ids: list[int], text: str, logprobs: list[TokenLogprobs]) -> RequestOutput:
        """The RequestOutput of what this step added to seq; a finished seq leaves the engine."""
        now = time.monotonic()
        first = seq.num_output_tokens == len(token_ids)  # the request's first output
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=seq.is_finished,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            new_logprobs=logprobs,
            prompt_logprobs=seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            ttft=now - seq.arrival_time if first else None,
            itl=None if first else now - self.last_token_time[seq.request_id],
            e2e=now - seq.arrival_time if seq.is_finished else None,
        )
        self.last_token_time[seq.request_id] = now
        if seq.is_finished:
            self.scheduler.finish(seq)
            self._forget(seq.request_id)
        return out

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        self.scheduler.abort(seq.request_id)
        self._forget(seq.request_id)
        seq.finish("error")
        self.num_failed += 1
        return RequestOutput(seq.request_id, [], "", True, seq.num_prompt_tokens, seq.num_output_tokens,
                             finish_reason="error", error=message)

    def _forget(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        self.last_token_time.pop(request_id, None)
