"""Request bodies of the OpenAI-compatible API (pydantic), and their sampling parameters.

Fields follow the OpenAI API plus vLLM's extras (top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, ignore_eos, include_stop_str_in_output); structured outputs (serve/structured.py)
and, on chat, tools and reasoning (serve/tools.py). Unknown fields are ignored, as in vLLM;
wrong types are rejected by pydantic and out-of-range values by SamplingParams (both: 400).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.serve.structured import StructuredFields
from flashdsa.serve.tools import ToolCall, ToolFields


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(StructuredFields):
    """The sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int], prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """SamplingParams of this request; ValueError on out-of-range values."""
        given = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
            if getattr(self, name) is not None
        }
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **given,
        )


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None


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


class TokenizeRequest(BaseModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: Optional[str] = None
    tokens: list[int]
