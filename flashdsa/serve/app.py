"""The FastAPI application: routes, Bearer auth on /v1, and errors in the OpenAI schema.

Every error answers ``{"error": {"message", "type", "param", "code"}}``: invalid fields and
malformed JSON 400, bad key 401, unknown model or route 404, queue full 503.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from flashdsa.models.chat_template import apply_chat_template
from flashdsa.runtime.async_engine import AsyncLLM, QueueFull
from flashdsa.serve.metrics import ServerMetrics
from flashdsa.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from flashdsa.serve.tools import template_messages

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


@dataclass
class ServerState:
    llm: AsyncLLM
    tokenizer: object
    model_name: str
    metrics: ServerMetrics
    api_key: Optional[str] = None
    created: int = 0

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def chat_prompt(
        self, messages: list, add_generation_prompt: bool = True, tools: Optional[list[dict]] = None,
        template_kwargs: Optional[dict] = None,
    ) -> list[int]:
        """Token ids of messages (and tools) rendered by the chat template (models/chat_template.py)."""
        dicts = template_messages(messages)
        try:
            text = apply_chat_template(self.tokenizer, dicts, tools=tools, add_generation_prompt=add_generation_prompt,
                                       **(template_kwargs or {}))
        except Exception as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def require_key(request: Request) -> None:
    key = state_of(request).api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise APIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').")


def build_app(state: ServerState) -> FastAPI:
    from flashdsa.serve.chat import chat_completions
    from flashdsa.serve.completions import completions

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.llm.start()
        yield
        state.llm.shutdown()

    state.created = int(time.time())
    app = FastAPI(title="flashdsa", lifespan=lifespan)
    app.state.server = state
    v1 = [Depends(require_key)]

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}")
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"{first.get('msg', 'invalid request')} ({param or 'body'})", param)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc), getattr(exc, "param", None))

    @app.exception_handler(QueueFull)
    async def on_queue_full(request: Request, exc: QueueFull):
        return error_response(503, str(exc))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health():
        alive = state.llm.is_alive()
        return Response(status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=v1)
    async def models():
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "flashdsa",
                "max_model_len": state.llm.engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=v1)
    async def v1_completions(body: CompletionRequest, request: Request):
        return await completions(state, body, request)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def v1_chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat_completions(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tokens = state.chat_prompt(body.messages)
        else:
            tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.llm.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        vocab = state.llm.engine.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    return app
