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

from pydantic import Field, field_validator, model_validator

from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.serve.api_model import APIModel, field_error
from flashdsa.serve.structured import StructuredFields
from flashdsa.serve.tools import ToolCall, ToolFields


class StreamOptions(APIModel):
    include_usage: bool = False


class SamplingFields(StructuredFields):
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


class TextPart(APIModel):
    type: Literal["text"]
    text: str


class ChatMessage(APIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    name: Optional[str] = None  # OpenAI's participant name: accepted, not rendered (V3.2's format has none)
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
