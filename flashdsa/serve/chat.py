"""POST /v1/chat/completions: messages through the chat template, streaming, with tool calls,
reasoning and structured outputs (serve/tools.py, serve/chat_output.py, serve/structured.py)."""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from flashdsa.runtime.sampling_params import MAX_LOGPROBS
from flashdsa.runtime.sequence import TokenLogprobs
from flashdsa.serve.app import ServerState
from flashdsa.serve.chat_output import ChatChoice
from flashdsa.serve.errors import APIError
from flashdsa.serve.generation import (choice_outputs, json_reply, new_id, sse_response, start_choices, usage,
                                       while_connected)
from flashdsa.serve.protocol import ChatCompletionRequest
from flashdsa.serve.tools import chat_params


def chat_logprobs(state: ServerState, entries: list[TokenLogprobs]) -> list[dict]:
    """The chat API's logprobs.content entries."""

    def item(token_id: int, logprob: float) -> dict:
        text = state.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top.items()]}
        for e in entries
    ]


def checked_max_tokens(body: ChatCompletionRequest) -> Optional[int]:
    """max_completion_tokens, else max_tokens (None: up to the context); 400 naming the field
    for logprob or length fields out of range."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", "top_logprobs")
    given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, given)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{given} must be >= 1, got {max_tokens}", given)
    return max_tokens


async def chat_completions(state: ServerState, body: ChatCompletionRequest, request: Request):
    state.check_model(body.model)
    max_tokens = checked_max_tokens(body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = await chat_params(state.llm.engine, body, state.sampling_params(body, max_tokens, logprobs))
    prompt = await run_in_threadpool(state.chat_prompt, body.messages, body.add_generation_prompt,
                                     body.continue_final_message, body.prompt_tools(), body.chat_template_kwargs)
    request_id = new_id("chatcmpl")
    group = await start_choices(state, request_id, [prompt], params, ChatCompletionRequest.model_fields)
    num_choices = params.n
    created, model = int(time.time()), state.model_name
    outputs = [ChatChoice(body.thinking, body.uses_tools, body.parallel_tool_calls) for _ in range(num_choices)]
    entries: list[list[TokenLogprobs]] = [[] for _ in range(num_choices)]
    finish: list[Optional[str]] = [None] * num_choices
    counts = [0] * num_choices
    cached = [0]

    def record(index: int, out) -> dict:
        """The message delta of this output."""
        entries[index] += out.new_logprobs
        counts[index] += len(out.new_token_ids)
        cached[0] = out.num_cached_tokens
        delta = outputs[index].add(out.new_text, out.finished)
        if out.finished:
            finish[index] = outputs[index].finish_reason(out.finish_reason)
        return delta

    def chunk(choices_json: list, usage_json: Optional[dict] = None) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices_json, "usage": usage_json}

    if body.stream:
        async def events() -> AsyncIterator[dict]:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(num_choices)])
            async for index, out in choice_outputs(group):
                delta = record(index, out)
                lp = {"content": chat_logprobs(state, out.new_logprobs)} if body.logprobs else None
                if delta or lp or out.finished:
                    yield chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish[index]}])
            if body.include_usage():
                yield chunk([], usage([prompt], sum(counts), cached[0]))

        return sse_response(events(), group)

    async for index, out in while_connected(request, group):
        record(index, out)

    def reply() -> dict:
        choices = [
            {"index": i, "message": outputs[i].message(),
             "logprobs": {"content": chat_logprobs(state, entries[i])} if body.logprobs else None,
             "finish_reason": finish[i]}
            for i in range(num_choices)
        ]
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage([prompt], sum(counts), cached[0])}

    return await json_reply(reply)
