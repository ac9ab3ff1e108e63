"""POST /v1/chat/completions: messages through the chat template, streaming, with tool calls,
reasoning and structured outputs (serve/tools.py, serve/chat_output.py, serve/structured.py)."""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from flashdsa.runtime.sequence import TokenLogprobs
from flashdsa.serve.app import APIError, ServerState
from flashdsa.serve.chat_output import ChatChoice
from flashdsa.serve.generation import merge, new_id, sse_stream, start_choices, token_text, usage, while_connected
from flashdsa.serve.protocol import ChatCompletionRequest
from flashdsa.serve.tools import chat_params


def chat_logprobs(tokenizer, entries: list[TokenLogprobs]) -> list[dict]:
    """The chat API's logprobs.content entries."""

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top.items()]}
        for e in entries
    ]


async def chat_completions(state: ServerState, body: ChatCompletionRequest, request: Request):
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = await chat_params(state.llm.engine, body, body.sampling_params(max_tokens, logprobs))
    prompt = state.chat_prompt(body.messages, body.add_generation_prompt, body.prompt_tools(), body.chat_template_kwargs)
    request_id = new_id("chatcmpl")
    streams = start_choices(state, request_id, [prompt], params)
    created, model, tok = int(time.time()), state.model_name, state.tokenizer
    outputs = [ChatChoice(body.thinking, body.uses_tools, body.parallel_tool_calls) for _ in streams]
    entries: list[list[TokenLogprobs]] = [[] for _ in streams]
    finish: list[Optional[str]] = [None] * len(streams)
    counts = [0] * len(streams)
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
                          "finish_reason": None} for i in range(len(streams))])
            async for index, out in merge(streams):
                delta = record(index, out)
                lp = {"content": chat_logprobs(tok, out.new_logprobs)} if body.logprobs else None
                if delta or lp or out.finished:
                    yield chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish[index]}])
            if body.include_usage():
                yield chunk([], usage([prompt], sum(counts), cached[0]))

        return StreamingResponse(sse_stream(events()), media_type="text/event-stream")

    async for index, out in while_connected(request, merge(streams)):
        record(index, out)
    choices = [
        {"index": i, "message": outputs[i].message(),
         "logprobs": {"content": chat_logprobs(tok, entries[i])} if body.logprobs else None,
         "finish_reason": finish[i]}
        for i in range(len(streams))
    ]
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage([prompt], sum(counts), cached[0])}
