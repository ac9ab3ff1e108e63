"""Request bodies of the OpenAI-compatible API (pydantic), and their sampling parameters.

Fields follow the OpenAI API plus vLLM's extras (top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens,
continue_final_message); structured outputs (serve/structured.py) and, on chat, tools and
reasoning (serve/tools.py). Every body derives from `APIModel`, which answers 400 naming the field
for (1) any field the model does not declare (unknown, or an API field this server does not
implement: never silently ignored; a null value counts as not given), and (2) text anywhere in
the body holding a lone UTF-16 surrogate (JSON allows "\\ud800"; no tokenizer can encode it). To
support a new field, declare it on the model. Wrong types are refused by pydantic and
out-of-range values by SamplingParams (both 400).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.serve.structured import StructuredFields
from flashdsa.serve.tools import ToolCall, ToolFields


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_path(value: Any) -> Optional[str]:
    """Dotted path of a string (key or value) in a JSON value that is not valid Unicode text, or
    None. Iterative: any nesting depth the JSON parser took is walked without recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str) and not _is_text(item):
            return path or "body"
        children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, child in children:
            if isinstance(key, str) and not _is_text(key):
                return path or "body"
            stack.append((f"{path}.{key}" if path else str(key), child))
    return None


def field_error(param: str, template: str) -> PydanticCustomError:
    """A validation error whose ctx names the field, for the 400's `param`; {param} in template
    is replaced by it (never format user input into the template itself)."""
    return PydanticCustomError("invalid_field", template, {"param": param})


class APIModel(BaseModel):
    """Base of request bodies: refuses undeclared fields and lone surrogates, naming them."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            raise field_error(path, "`{param}` holds a lone UTF-16 surrogate, which is not valid Unicode text")
        return data

    @model_validator(mode="after")
    def _refuse_undeclared_fields(self) -> "APIModel":
        for name, value in (self.model_extra or {}).items():
            if value is not None:
                raise field_error(name, "`{param}` is not supported by this server")
        return self


class StreamOptions(APIModel):
    include_usage: bool = False


class SamplingFields(APIModel, StructuredFields):
    """The sampling fields shared by completions and chat completions (structured outputs too)."""

    model: Optional[str] = None
    user: Optional[str] = None  # end-user id for the caller's own tracking; no effect here
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key in bias or {}:
            try:
                int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key!r}") from None
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed when stream is true")
        return self

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self,
        max_tokens: Optional[int],
        logprobs: Optional[int],
        prompt_logprobs: Optional[int] = None,
        defaults: Optional[dict] = None,
    ) -> SamplingParams:
        """SamplingParams of this request over the server's defaults (from the checkpoint's
        generation_config.json); ValueError on out-of-range values."""
        given = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
            if getattr(self, name) is not None
        }
        if max_tokens is not None:
            given["max_tokens"] = max_tokens
        return SamplingParams(**{
            "max_tokens": None,
            **(defaults or {}),
            **given,
            "n": self.n,
            "seed": self.seed,
            "min_tokens": self.min_tokens,
            "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()},
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
        })


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None
    reasoning_content: Optional[str] = None  # an assistant turn's (rendered only in thinking mode)
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None  # a tool result's; results are rendered in message order

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self) -> "ChatCompletionRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error("continue_final_message",
                              "continue_final_message needs add_generation_prompt=false (the final message is continued, "
                              "no new turn is opened)")
        return self


class TokenizeRequest(APIModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(APIModel):
    model: Optional[str] = None
    tokens: list[int]
