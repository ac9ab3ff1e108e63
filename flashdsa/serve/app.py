"""The FastAPI application: routes, Bearer auth, caps on bodies, errors in the OpenAI schema
(see errors.py). Tokenization, chat templates and detokenization run in the thread pool, so a
large input never stalls the event loop that serves every other request."""

from __future__ import annotations

import contextlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from flashdsa.models.chat_template import apply_chat_template
from flashdsa.runtime.async_engine import AsyncLLM
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.serve.errors import APIError, error_response, install_error_handlers, invalid_field
from flashdsa.serve.limits import LimitBody, RequestLimits
from flashdsa.serve.metrics import ServerMetrics
from flashdsa.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from flashdsa.serve.tools import template_messages


@dataclass
class ServerState:
    llm: AsyncLLM
    tokenizer: object
    model_name: str
    metrics: ServerMetrics
    api_key: Optional[str] = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    sampling_defaults: dict = field(default_factory=dict)  # from the checkpoint's generation_config.json
    created: int = 0
    _token_texts: dict[int, str] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def sampling_params(self, body: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs, self.sampling_defaults)
        except ValueError as exc:
            raise invalid_field(exc, type(body).model_fields) from exc

    def chat_prompt(
        self, messages: list, add_generation_prompt: bool = True, continue_final_message: bool = False,
        tools: Optional[list[dict]] = None, template_kwargs: Optional[dict] = None,
    ) -> list[int]:
        """Token ids of messages (and tools) rendered by the chat template (models/chat_template.py);
        blocking: call it in the thread pool."""
        dicts = template_messages(messages)
        try:
            text = apply_chat_template(self.tokenizer, dicts, tools=tools, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, **(template_kwargs or {}))
        except Exception as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The text of one token (as the logprobs show it), cached."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "flashdsa",
                "max_model_len": self.max_model_len}


class RequireKey:
    """ASGI middleware: every route but the open ones answers 401 without 'Authorization: Bearer
    KEY', before the body is read (so an unauthenticated caller costs nothing)."""

    OPEN_PATHS = ("/health", "/metrics")

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                message = "Invalid or missing API key (send 'Authorization: Bearer <key>')."
                await error_response(401, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    """The app serving state; the engine thread runs while the app does (lifespan)."""
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
    install_error_handlers(app)
    app.add_middleware(LimitBody, max_bytes=state.limits.max_request_bytes)
    if state.api_key is not None:
        app.add_middleware(RequireKey, key=state.api_key)  # outermost: no key, nothing read

    @app.get("/health")
    async def health():
        if not state.llm.is_alive():
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        state.check_model(model_id)
        return state.model_card()

    @app.post("/v1/completions")
    async def v1_completions(body: CompletionRequest, request: Request):
        return await completions(state, body, request)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat_completions(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")

        def run() -> JSONResponse:
            if body.messages is not None:
                tokens = state.chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message)
            else:
                tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len})

        return await run_in_threadpool(run)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        vocab = state.llm.engine.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "tokens")
        return await run_in_threadpool(lambda: JSONResponse({"prompt": state.tokenizer.decode(body.tokens)}))

    return app
