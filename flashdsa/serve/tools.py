"""Tool-calling and reasoning fields of chat requests, for DeepSeek-V3.2's chat format.

``tools`` are rendered into the prompt by the chat template. ``tool_choice`` "auto" (the default
with tools) lets the model call them; "none" (the default without) leaves them out of the prompt;
"required" or a named function forces a call through a grammar of the format's DSML call syntax
(xgrammar's "deepseek_v3_2" structural tag), so each call names a given function and its
arguments are valid JSON for that function's schema (unless the function sets strict: false).
``chat_template_kwargs`` {"thinking": true} (or "enable_thinking") asks for a reasoning block,
returned as reasoning_content. Tool calls and reasoning are parsed from the text, so those
requests keep special tokens in it (DeepSeek-V3.2's DSML marker is one).
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import replace
from typing import Any, Literal, Optional, Union

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.structured import MAX_JSON_WHITESPACE, StructuredOutputsParams
from flashdsa.serve.api_model import APIModel
from flashdsa.serve.structured import FieldError, with_grammar

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule; the name is quoted in the DSML call
# apply_chat_template's own arguments: chat_template_kwargs may not set them (tokenize, chat_template, ...)
RESERVED_TEMPLATE_KWARGS = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)


class FunctionDefinition(APIModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(APIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(APIModel):
    name: str


class NamedToolChoice(APIModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(APIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(APIModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolFields(APIModel):
    """The chat request's tool and reasoning fields."""

    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @property
    def thinking(self) -> bool:
        kwargs = self.chat_template_kwargs or {}
        return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))

    @property
    def uses_tools(self) -> bool:
        """Whether the model may call tools (they are in the prompt and its calls are parsed)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_call(self) -> bool:
        """tool_choice "required" or a named function."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def check_fields(self) -> None:
        """FieldError for bad tool names, duplicates, a tool_choice the tools cannot meet, or
        chat_template_kwargs that would set apply_chat_template's own arguments."""
        for key in RESERVED_TEMPLATE_KWARGS.intersection(self.chat_template_kwargs or {}):
            raise FieldError(f"chat_template_kwargs may not set {key!r}", f"chat_template_kwargs.{key}")
        names = [tool.function.name for tool in self.tools or []]
        for i, name in enumerate(names):
            if not TOOL_NAME.fullmatch(name):
                raise FieldError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}",
                                 f"tools[{i}].function.name")
            if name in names[:i]:
                raise FieldError(f"tools[{i}].function.name {name!r} is given twice", f"tools[{i}].function.name")
        if self.forces_call and not names:
            raise FieldError("tool_choice 'required' or a named function needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise FieldError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools", "tool_choice")

    def prompt_tools(self) -> Optional[list[dict]]:
        """The tools the chat template renders (OpenAI format), or None."""
        if not self.uses_tools:
            return None
        return [tool.model_dump(exclude_unset=True) for tool in self.tools]

    def tool_grammar(self) -> Optional[StructuredOutputsParams]:
        """The grammar that forces a call ("required" or a named function), else None."""
        if not self.forces_call:
            return None
        choice = self.tool_choice if self.tool_choice == "required" else self.tool_choice.model_dump()
        tag = xgr.get_model_structural_tag(
            "deepseek_v3_2", tools=self.prompt_tools(), tool_choice=choice,
            reasoning="enabled" if self.thinking else "disabled",
            parallel_tool_calls=self.parallel_tool_calls, max_whitespace_cnt=MAX_JSON_WHITESPACE,
        )
        return StructuredOutputsParams(structural_tag=tag.model_dump_json(), source="tools")


def template_messages(messages: list) -> list[dict]:
    """Chat messages as the template takes them: text content, reasoning, and tool calls whose
    arguments are parsed from their JSON text (FieldError naming the one that is not JSON)."""
    result = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        calls = []
        for j, call in enumerate(message.tool_calls or []):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                raise FieldError(f"tool call arguments are not JSON: {exc}",
                                 f"messages[{i}].tool_calls[{j}].function.arguments") from None
            if not isinstance(arguments, dict):
                raise FieldError("tool call arguments must be a JSON object",
                                 f"messages[{i}].tool_calls[{j}].function.arguments")
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": function})
        if calls:
            entry["tool_calls"] = calls
        result.append(entry)
    return result


async def chat_params(engine, body, params: SamplingParams) -> SamplingParams:
    """params of a chat request (a ToolFields and StructuredFields body): its grammar (a forced
    tool call, or response_format / guided_*, after the reasoning in thinking mode) compiled, and
    special tokens kept in the text when tool calls or reasoning are parsed from it."""
    body.check_fields()
    forced = body.tool_grammar()
    structured = body.structured_outputs(after_reasoning=body.thinking)
    if forced is not None and structured is not None:
        raise FieldError("tool_choice 'required' or a named function cannot be combined with "
                         "response_format or guided_* (the call has its own grammar)", "tool_choice")
    params = await with_grammar(engine, params, forced or structured)
    return replace(params, skip_special_tokens=False) if body.uses_tools or body.thinking else params
