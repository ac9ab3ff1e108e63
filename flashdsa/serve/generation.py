"""What completions and chat share: fan a request out into engine requests (prompts x n
choices), merge their streams, SSE framing and usage."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import AsyncIterator

from fastapi import Request

from flashdsa.runtime.engine import RequestOutput
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.serve.app import APIError, ServerState, error_body

_DONE = object()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def start_choices(
    state: ServerState, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> list[AsyncIterator[RequestOutput]]:
    """One engine request per (prompt i, choice j), choice index i * n + j; validated up front
    so that a bad request is refused (400/503) before any response starts."""
    for ids in prompts:
        state.llm.check(ids, params, count=len(prompts) * params.n)
    return [
        state.llm.generate(f"{request_id}-{i}-{j}", ids, params.for_choice(j))
        for i, ids in enumerate(prompts)
        for j in range(params.n)
    ]


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave outputs of several requests as (choice index, output). Stopping early (client
    gone) cancels the pumps, which aborts the unfinished requests."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                merged.put_nowait((index, out))
        except Exception as exc:
            merged.put_nowait((index, exc))
        finally:
            merged.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                if item.error is not None:
                    raise APIError(500, f"generation failed: {item.error}")
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def while_connected(request: Request, items: AsyncIterator) -> AsyncIterator:
    """items until the client goes away (for non-streaming responses; a streaming response is
    cancelled by the server itself); closing items then aborts the requests behind them."""
    async with contextlib.aclosing(items):
        async for item in items:
            yield item
            if await request.is_disconnected():
                return


def usage(prompts: list[list[int]], completion_tokens: int, cached_tokens: int = 0) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def sse_stream(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """SSE frames of events, then [DONE]; a failure mid-stream becomes an error event."""
    try:
        async for event in events:
            yield sse(event)
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param))
    except ValueError as exc:
        yield sse(error_body(400, str(exc)))
    yield sse("[DONE]")


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])
