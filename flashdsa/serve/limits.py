"""Per-request caps of the server, so that no single request can take what all the others need.

The body size (413, `LimitBody`), then what a valid body may ask for: choices (n, best_of), stop
strings (each is searched after every token, on the engine thread that serves every request) and
the logprob entries a request can return (each is a JSON object in the reply: a 3 KB echo request
can otherwise ask for a 50 MB one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashdsa.runtime.checks import check
from flashdsa.runtime.sampling_params import MAX_LOGPROBS, SamplingParams
from flashdsa.serve.errors import error_response


@dataclass
class RequestLimits:
    """max_logprob_entries None: 2**20, or one full-length choice with the most alternatives if more."""

    max_request_bytes: int = 4 * 2**20
    max_n: int = 128  # the OpenAI API's limit on n
    max_stop: int = 64
    max_logprob_entries: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_n", "max_stop", "max_logprob_entries"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"{name} must be >= 1, got {value}")

    def logprob_entries_cap(self, max_model_len: int) -> int:
        if self.max_logprob_entries is not None:
            return self.max_logprob_entries
        return max(2**20, max_model_len * (MAX_LOGPROBS + 1))

    def check(self, params: SamplingParams, prompt_lengths: list[int], max_model_len: int) -> None:
        """ValueError naming the cap a request (its prompts x params.n choices) goes over."""
        check(params.n <= self.max_n, f"n (with best_of) must be <= {self.max_n} on this server, got {params.n}")
        check(len(params.stop) <= self.max_stop,
              f"stop may hold at most {self.max_stop} strings on this server, got {len(params.stop)}")
        entries = 0
        for length in prompt_lengths:
            if params.prompt_logprobs is not None:
                entries += length * (params.prompt_logprobs + 1)
            if params.logprobs is not None:
                max_tokens = max_model_len - length if params.max_tokens is None else params.max_tokens
                entries += max(max_tokens, 0) * (params.logprobs + 1)
        entries *= params.n
        cap = self.logprob_entries_cap(max_model_len)
        check(entries <= cap,
              f"logprobs could fill {entries} entries (choices x tokens x (1 + alternatives), prompt included with "
              f"echo), over this server's cap of {cap}; lower n, logprobs (top_logprobs) or max_tokens")


class LimitBody:
    """ASGI middleware: a body over max_bytes gets a 413 in the OpenAI schema, refused unread when
    its Content-Length says so, else once the bytes received pass the limit (chunked bodies)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, self.message)(scope, receive, send)
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self.message)  # answered by the app's HTTPException handler
            return message

        await self.app(scope, counted, send)

    @property
    def message(self) -> str:
        return f"the request body is over this server's limit of {self.max_bytes} bytes"
