"""Structured-output fields of the OpenAI API: response_format and vLLM's guided_* extras.

``response_format`` {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
"schema", "strict"}} (the grammar holds the output to the schema whether or not strict is set),
``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar`` (EBNF). At most one
may be given. The grammar is compiled before the request is admitted, off the event loop, so a
schema that cannot compile is a 400 naming its field.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field

from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.structured import StructuredOutputsParams
from flashdsa.serve.api_model import APIModel


class FieldError(ValueError):
    """A bad request field: the server answers 400 with ``param`` set to the field's name."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(APIModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: Optional[str] = None
    json_schema: Union[dict[str, Any], bool] = Field(default=True, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(APIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredFields(APIModel):
    """The structured-output fields shared by completions and chat completions."""

    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def structured_outputs(self, after_reasoning: bool = False) -> Optional[StructuredOutputsParams]:
        """The grammar these fields ask for (None: free text); FieldError naming the field."""
        given = {
            name: value
            for name, value in (("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
                                ("guided_choice", self.guided_choice), ("guided_grammar", self.guided_grammar))
            if value is not None
        }
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            given["response_format"] = fmt
        if len(given) > 1:
            raise FieldError(f"give at most one of {', '.join(given)}", next(iter(given)))
        if not given:
            return None
        (name, value), = given.items()
        if name != "response_format":
            return _grammar(name, {name.removeprefix("guided_"): value}, after_reasoning)
        if value.type == "json_object":
            return _grammar(name, {"json_object": True}, after_reasoning)
        if value.json_schema is None:
            raise FieldError("response_format.json_schema is required when type is json_schema", "response_format")
        return _grammar("response_format.json_schema.schema", {"json": value.json_schema.json_schema}, after_reasoning)


def _grammar(source: str, kind: dict, after_reasoning: bool) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kind, after_reasoning=after_reasoning, source=source)
    except ValueError as exc:
        raise FieldError(str(exc), source) from None


async def with_grammar(engine, params: SamplingParams, grammar: Optional[StructuredOutputsParams]) -> SamplingParams:
    """params with the grammar, compiled here first (in a thread; the engine then finds it in the
    compiler's cache); FieldError naming the field if it does not compile."""
    if grammar is None:
        return params
    try:
        await asyncio.to_thread(engine.grammars.compile, grammar)
        return replace(params, structured_outputs=grammar)
    except ValueError as exc:
        raise FieldError(str(exc), grammar.source) from None
