"""What completions and chat share: fan a request out into engine requests (prompts x n
choices), read their outputs, SSE framing (sse-starlette) and usage."""

from __future__ import annotations

import json
import logging
import uuid
from typing import AsyncIterator, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from flashdsa.runtime.async_engine import RequestGroup
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.sequence import RequestOutput
from flashdsa.serve.app import ServerState
from flashdsa.serve.errors import APIError, error_body, invalid_field

logger = logging.getLogger(__name__)

T = TypeVar("T")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def start_choices(
    state: ServerState, request_id: str, prompts: list[list[int]], params: SamplingParams, fields: dict
) -> RequestGroup:
    """One engine request per (prompt i, choice j), choice index i * n + j, all admitted at once:
    a request that is invalid (400, the param named when it is one of fields) or finds no place
    (503) is refused before any response starts. Validation runs in the thread pool (it reads
    every prompt token)."""

    def check() -> None:
        state.limits.check(params, [len(ids) for ids in prompts], state.max_model_len)
        for ids in prompts:
            state.llm.check(ids, params, count=len(prompts) * params.n)

    try:
        await run_in_threadpool(check)
    except ValueError as exc:
        raise invalid_field(exc, fields) from exc
    return state.llm.add([
        (f"{request_id}-{i}-{j}", ids, params.for_choice(j))
        for i, ids in enumerate(prompts)
        for j in range(params.n)
    ])


async def choice_outputs(group: RequestGroup) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) as they come; a failed choice raises a 500 APIError."""
    async for index, out in group:
        if out.error is not None:
            raise APIError(500, f"generation failed: {out.error}")
        yield index, out


async def while_connected(request: Request, group: RequestGroup) -> AsyncIterator[tuple[int, RequestOutput]]:
    """choice_outputs(group) until the client goes away (for non-streaming responses); the
    unfinished requests are then aborted, as after a failure."""
    try:
        async for item in choice_outputs(group):
            yield item
            if await request.is_disconnected():
                return
    finally:
        group.close()


async def delta_of(choice_delta: Callable[[RequestOutput], T], out: RequestOutput) -> T:
    """choice_delta(out), in the thread pool when out carries prompt logprobs (a prompt's length
    times up to 21 entries to turn into JSON objects), inline otherwise (one token's worth)."""
    if out.prompt_logprobs:
        return await run_in_threadpool(choice_delta, out)
    return choice_delta(out)


async def json_reply(build: Callable[[], dict]) -> JSONResponse:
    """The JSON response of build(), assembled and serialised in the thread pool (a reply can
    hold up to the logprob cap's entries)."""
    return await run_in_threadpool(lambda: JSONResponse(build()))


def sse_response(events: AsyncIterator[dict], group: RequestGroup) -> EventSourceResponse:
    """Stream events as SSE `data:` lines, then `data: [DONE]`. A failure mid-stream becomes an
    OpenAI error event before [DONE]; a client that goes away, or any end, aborts the unfinished
    requests of group."""

    async def frames() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield json.dumps(event, ensure_ascii=False)
        except APIError as exc:
            yield json.dumps(error_body(exc.status, exc.message, exc.param))
        except Exception as exc:
            logger.exception("stream failed")
            yield json.dumps(error_body(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            group.close()
        yield "[DONE]"

    return EventSourceResponse(frames(), sep="\n")


def usage(prompts: list[list[int]], completion_tokens: int, cached_tokens: int = 0) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
