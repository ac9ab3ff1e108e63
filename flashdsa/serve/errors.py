"""Errors in the OpenAI schema: ``{"error": {"message", "type", "param", "code"}}``.

Invalid fields and malformed JSON 400, bad key 401, unknown model or route 404, body too large
413, a request whose processing failed 500, no place or no engine 503. Every error is answered
by a handler (never re-raised to uvicorn, which would close the keep-alive connection).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashdsa.runtime.async_engine import Unavailable

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}
UNION_BRANCHES = {"str", "int", "float", "bool", "none"}  # pydantic's names for the branches of a union


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def invalid_field(exc: ValueError, fields: Iterable[str]) -> APIError:
    """A 400 for a ValueError whose message starts with the field it names (as SamplingParams',
    the engine's and the caps' do); param is that word when it is one of fields."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    return APIError(400, message, first if first in fields else None)


def field_path(loc: tuple) -> str:
    """The field a pydantic error location names, as a dotted path (``messages.0.content``),
    without the leading "body" and the names of union branches pydantic adds (``str``, ``list[int]``)."""
    parts = [p for p in loc[1:] if isinstance(p, int) or (str(p).isidentifier() and p not in UNION_BRANCHES)]
    return ".".join(str(p) for p in parts)


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


class AnswerEveryError:
    """ASGI middleware: an exception no handler took becomes a logged 500 in the OpenAI schema,
    instead of reaching uvicorn (which would drop the connection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_and_note(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as exc:
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if scope["type"] == "http" and not started:
                await error_response(500, f"internal error: {type(exc).__name__}: {exc}")(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_middleware(AnswerEveryError)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}")
        param = first.get("ctx", {}).get("param") or field_path(first.get("loc", ())) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return error_response(400, message if f"`{param}`" in message else f"{message} ({param or 'body'})", param)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc), getattr(exc, "param", None))  # serve.structured.FieldError names it

    @app.exception_handler(Unavailable)
    async def on_unavailable(request: Request, exc: Unavailable):
        return error_response(503, str(exc))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))
