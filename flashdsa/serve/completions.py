"""POST /v1/completions: string or token-id prompts (one or many), echo (with max_tokens 0:
prompt scoring), best_of, logprobs, structured outputs (serve/structured.py), streaming."""

from __future__ import annotations

import dataclasses
import time
from typing import AsyncIterator, Optional

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from flashdsa.runtime.sequence import RequestOutput, TokenLogprobs
from flashdsa.serve.app import ServerState
from flashdsa.serve.errors import APIError
from flashdsa.serve.generation import (
    choice_outputs,
    delta_of,
    json_reply,
    new_id,
    sse_response,
    start_choices,
    usage,
    while_connected,
)
from flashdsa.serve.protocol import CompletionRequest
from flashdsa.serve.structured import with_grammar


def prompt_lists(state: ServerState, prompt) -> tuple[list[list[int]], list]:
    """The request's prompts as token-id lists, and as sent (one string or id list each);
    blocking: call it in the thread pool."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    return [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt], list(prompt)


def legacy_logprobs(state: ServerState, entries: list[Optional[TokenLogprobs]], ids: list[int], offset: int) -> dict:
    """The completions API logprobs object for tokens ids (entries None: no logprob, as for
    the first prompt token); text_offset counts from offset."""
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(ids, entries):
        text = state.token_text(token_id)
        result["tokens"].append(text)
        result["token_logprobs"].append(None if entry is None else entry.logprob)
        top = None if entry is None else {state.token_text(t): lp for t, lp in entry.top.items()}
        result["top_logprobs"].append(top)
        result["text_offset"].append(offset)
        offset += len(text)
    return result


class CompletionChoice:
    """Accumulates one choice; produces its deltas (stream) or its final form."""

    def __init__(self, state: ServerState, body: CompletionRequest, prompt: list[int], echo_text: str) -> None:
        self.state, self.body, self.prompt, self.echo_text = state, body, prompt, echo_text
        self.text_len = 0
        self.started = False
        self.pieces: list[str] = []
        self.logprob_parts: list[dict] = []
        self.num_tokens = 0
        self.cumulative_logprob = 0.0  # of the generated tokens, to rank best_of choices
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.cached_tokens = 0

    def delta(self, out: RequestOutput) -> tuple[str, Optional[dict]]:
        """Text and logprobs this output adds (echo: the prompt comes first)."""
        text, ids, entries = out.new_text, list(out.new_token_ids), list(out.new_logprobs)
        self.cumulative_logprob += sum(e.logprob for e in out.new_logprobs)
        if self.body.echo and not self.started:
            text = self.echo_text + text
            if self.body.logprobs is not None:
                ids = self.prompt + ids
                entries = list(out.prompt_logprobs or [None] * len(self.prompt)) + entries
        self.started = True
        lp = None
        if self.body.logprobs is not None:
            lp = legacy_logprobs(self.state, entries, ids, self.text_len)
            self.logprob_parts.append(lp)
        self.text_len += len(text)
        self.pieces.append(text)
        self.num_tokens += len(out.new_token_ids)
        self.cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return text, lp

    def final(self, index: int) -> dict:
        parts = self.logprob_parts
        logprobs = {key: [v for p in parts for v in p[key]] for key in parts[0]} if parts else None
        return {"index": index, "text": "".join(self.pieces), "logprobs": logprobs,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}


def check_fields(body: CompletionRequest) -> int:
    """The number of choices to generate per prompt (best_of, default n); 400 on bad combinations."""
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)", "max_tokens")
    best_of = body.n if body.best_of is None else body.best_of
    if best_of < body.n:
        raise APIError(400, f"best_of ({best_of}) must be >= n ({body.n})", "best_of")
    if best_of > body.n and body.stream:
        raise APIError(400, "best_of > n cannot be streamed (the best choices are known at the end)", "best_of")
    return best_of


async def completions(state: ServerState, body: CompletionRequest, request: Request):
    state.check_model(body.model)
    best_of = check_fields(body)
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if body.max_tokens == 0 and echo_logprobs is None:
        echo_logprobs = 0  # an engine run of the prompt alone must score it (the reply leaves them out)
    params = state.sampling_params(body, body.max_tokens, body.logprobs, prompt_logprobs=echo_logprobs)
    params = await with_grammar(state.llm.engine, params, body.structured_outputs())
    if best_of > params.n:  # ranking needs each sampled token's logprob
        params = dataclasses.replace(params, n=best_of, logprobs=params.logprobs or 0)
    prompts, sent = await run_in_threadpool(prompt_lists, state, body.prompt)
    request_id = new_id("cmpl")
    group = await start_choices(state, request_id, prompts, params, CompletionRequest.model_fields)
    echo_texts = [""] * len(prompts)
    if body.echo:  # the prompts as sent; id prompts decoded once each, now that their ids are checked
        try:
            echo_texts = await run_in_threadpool(
                lambda: [p if isinstance(p, str) else state.tokenizer.decode(p) for p in sent])
        except BaseException:
            group.close()
            raise
    choices = [CompletionChoice(state, body, prompts[i // params.n], echo_texts[i // params.n])
               for i in range(len(prompts) * params.n)]
    created, model = int(time.time()), state.model_name

    def chunk(choices_json: list, usage_json: Optional[dict] = None) -> dict:
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices_json, "usage": usage_json}

    def total_usage() -> dict:
        cached = sum(c.cached_tokens for c in choices[:: params.n])  # the first choice of each prompt
        return usage(prompts, sum(c.num_tokens for c in choices), cached)

    if body.stream:
        async def events() -> AsyncIterator[dict]:
            async for index, out in choice_outputs(group):
                text, lp = await delta_of(choices[index].delta, out)
                yield chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason":
                              out.finish_reason if out.finished else None,
                              "stop_reason": out.stop_reason if out.finished else None}])
            if body.include_usage():
                yield chunk([], total_usage())

        return sse_response(events(), group)

    async for index, out in while_connected(request, group):
        await delta_of(choices[index].delta, out)
    kept = []
    for i in range(len(prompts)):  # the n best of each prompt's best_of choices, by cumulative logprob
        mine = choices[i * params.n : (i + 1) * params.n]
        kept += sorted(mine, key=lambda c: -c.cumulative_logprob)[: body.n] if params.n > body.n else mine
    return await json_reply(lambda: chunk([c.final(i) for i, c in enumerate(kept)], total_usage()))
