"""POST /v1/completions: string or token-id prompts (one or many), echo, logprobs, streaming."""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from flashdsa.runtime.engine import RequestOutput
from flashdsa.runtime.sequence import TokenLogprobs
from flashdsa.serve.app import APIError, ServerState
from flashdsa.serve.generation import merge, new_id, sse_stream, start_choices, token_text, usage, while_connected
from flashdsa.serve.protocol import CompletionRequest
from flashdsa.serve.structured import with_grammar


def prompt_lists(state: ServerState, prompt) -> tuple[list[list[int]], list]:
    """The request's prompts as token-id lists, and as sent (one string or id list each)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    ids = [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    return ids, list(prompt)


def legacy_logprobs(tokenizer, entries: list[Optional[TokenLogprobs]], ids: list[int], offset: int) -> dict:
    """The completions API logprobs object for tokens ids (entries None: no logprob, as for
    the first prompt token); text_offset counts from offset."""
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(ids, entries):
        text = token_text(tokenizer, token_id)
        result["tokens"].append(text)
        result["token_logprobs"].append(None if entry is None else entry.logprob)
        top = None if entry is None else {token_text(tokenizer, t): lp for t, lp in entry.top.items()}
        result["top_logprobs"].append(top)
        result["text_offset"].append(offset)
        offset += len(text)
    return result


class CompletionChoice:
    """Accumulates one choice; produces its deltas (stream) or its final form."""

    def __init__(self, state: ServerState, body: CompletionRequest, prompt: list[int], sent) -> None:
        self.state, self.body, self.prompt, self.sent = state, body, prompt, sent
        self.text_len = 0
        self.started = False
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.cached_tokens = 0

    def delta(self, out: RequestOutput) -> tuple[str, Optional[dict]]:
        """Text and logprobs this output adds (echo: the prompt comes first)."""
        tok = self.state.tokenizer
        text, ids, entries = out.new_text, list(out.new_token_ids), list(out.new_logprobs)
        if self.body.echo and not self.started:
            text = (self.sent if isinstance(self.sent, str) else tok.decode(self.prompt)) + text
            if self.body.logprobs is not None:
                ids = self.prompt + ids
                entries = list(out.prompt_logprobs or [None] * len(self.prompt)) + entries
        self.started = True
        lp = None
        if self.body.logprobs is not None:
            lp = legacy_logprobs(tok, entries, ids, self.text_len)
        self.text_len += len(text)
        self.pieces.append(text)
        self.token_ids += out.new_token_ids
        self.cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return text, lp


def merge_logprobs(parts: list[Optional[dict]]) -> Optional[dict]:
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return {key: [v for p in parts for v in p[key]] for key in parts[0]}


async def completions(state: ServerState, body: CompletionRequest, request: Request):
    state.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    prompts, sent = prompt_lists(state, body.prompt)
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    params = body.sampling_params(body.max_tokens, body.logprobs, prompt_logprobs=echo_logprobs)
    params = await with_grammar(state.llm.engine, params, body.structured_outputs())
    request_id = new_id("cmpl")
    streams = start_choices(state, request_id, prompts, params)
    choices = [CompletionChoice(state, body, prompts[i // params.n], sent[i // params.n])
               for i in range(len(streams))]
    created, model = int(time.time()), state.model_name

    def chunk(choices_json: list, usage_json: Optional[dict] = None) -> dict:
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices_json, "usage": usage_json}

    def total_usage() -> dict:
        cached = sum(c.cached_tokens for c in choices[:: params.n])  # the first choice of each prompt
        return usage(prompts, sum(len(c.token_ids) for c in choices), cached)

    if body.stream:
        async def events() -> AsyncIterator[dict]:
            async for index, out in merge(streams):
                text, lp = choices[index].delta(out)
                yield chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason":
                              out.finish_reason if out.finished else None,
                              "stop_reason": out.stop_reason if out.finished else None}])
            if body.include_usage():
                yield chunk([], total_usage())

        return StreamingResponse(sse_stream(events()), media_type="text/event-stream")

    logprob_parts: dict[int, list] = {i: [] for i in range(len(choices))}
    async for index, out in while_connected(request, merge(streams)):
        logprob_parts[index].append(choices[index].delta(out)[1])
    body_json = chunk(
        [{"index": i, "text": "".join(c.pieces), "logprobs": merge_logprobs(logprob_parts[i]),
          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for i, c in enumerate(choices)],
        total_usage(),
    )
    return body_json
