"""From sampled tokens to what a request's caller sees: stop conditions, text and latencies.

``OutputProcessor.append_tokens`` appends a step's new tokens to a sequence up to the one that
ends it (EOS, a stop token id, a stop string, the grammar's end, max_tokens, max_model_len; none
before min_tokens), detokenizes them incrementally and returns one ``RequestOutput``. A finished
sequence leaves the scheduler, which frees its blocks.
"""

from __future__ import annotations

import time
from typing import Optional

from flashdsa.runtime.detokenizer import Detokenizer
from flashdsa.runtime.scheduler import Scheduler
from flashdsa.runtime.sequence import RequestOutput, Sequence, TokenLogprobs
from flashdsa.runtime.structured import advance


class OutputProcessor:
    """The detokenizers and last-token times of the requests in the engine."""

    def __init__(self, tokenizer, scheduler: Scheduler, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.detokenizers: dict[str, Detokenizer] = {}
        self.last_token_time: dict[str, float] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.detokenizers

    def add(self, seq: Sequence) -> None:
        params = seq.params
        self.detokenizers[seq.request_id] = Detokenizer(
            self.tokenizer, seq.token_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )

    def forget(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        self.last_token_time.pop(request_id, None)

    def append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[Optional[TokenLogprobs]]) -> RequestOutput:
        """Append the step's tokens, up to the one that finishes the sequence, as one output."""
        text, kept = "", 0
        for token in tokens:
            text += self._append_token(seq, token)
            kept += 1
            if seq.is_finished:
                break
        return self.output(seq, tokens[:kept], text, [lp for lp in logprobs[:kept] if lp is not None])

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

    def output(self, seq: Sequence, token_ids: list[int], text: str, logprobs: list[TokenLogprobs]) -> RequestOutput:
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
            self.forget(seq.request_id)
        return out
