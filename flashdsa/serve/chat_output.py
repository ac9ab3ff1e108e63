"""One chat choice's output as OpenAI message parts: content, reasoning_content and tool_calls,
both as streaming deltas and as the final message (the same parse serves both)."""

from __future__ import annotations

import uuid
from typing import Optional

from flashdsa.serve.dsml import OutputParser


class ChatChoice:
    """Accumulates one choice. thinking: split off the reasoning; parse_tools: parse tool calls;
    parallel_tool_calls False keeps only the first call."""

    def __init__(self, thinking: bool = False, parse_tools: bool = False, parallel_tool_calls: bool = True) -> None:
        self.parser = OutputParser(thinking, parse_tools) if thinking or parse_tools else None
        self.thinking = thinking
        self.parallel_tool_calls = parallel_tool_calls
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[dict] = []

    def add(self, text: str, final: bool) -> dict:
        """The delta this text adds (only the fields it has; plain choices always carry content)."""
        if self.parser is None:
            self.content += text
            return {"content": text}
        parsed = self.parser.feed(text, final)
        self.reasoning += parsed.reasoning
        self.content += parsed.content
        delta: dict = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        calls = [self._call_delta(c.index, c.name, c.arguments) for c in parsed.calls
                 if self.parallel_tool_calls or c.index == 0]
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _call_delta(self, index: int, name: Optional[str], arguments: str) -> dict:
        if name is not None:  # the call's first delta: it gets its id
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            self.tool_calls.append(call)
            return {"index": index, **call, "function": dict(call["function"])}  # its own copy: the call grows
        self.tool_calls[index]["function"]["arguments"] += arguments
        return {"index": index, "function": {"arguments": arguments}}

    def message(self) -> dict:
        """The final assistant message (content None when it only calls tools, as OpenAI's)."""
        message: dict = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.thinking:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """"tool_calls" for a choice that ended by calling tools, else reason."""
        return "tool_calls" if reason == "stop" and self.tool_calls else reason
