"""DeepSeek-V3.2's assistant output parsed as it streams: reasoning, reply text, DSML tool calls.

In thinking mode the prompt ends with ``<think>``, so the output is reasoning up to ``</think>``,
then the reply. A reply that calls tools ends with a block in DSML (DeepSeek's markup)::

    \\n\\n<｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

where string="true" values are raw text and the others JSON. ``OutputParser.feed`` takes text in
pieces cut anywhere and returns what the pieces made certain; a marker cut in two is held back
until it is whole. A call's arguments arrive as JSON fragments, one per parameter as it closes,
that concatenate to ``json.dumps`` of its parameters. Text that breaks the call syntax (possible
only when no grammar enforces it) is returned as reply text from there on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from flashdsa.models.chat_template import DSML, THINK_END

CALLS_BEGIN = f"<{DSML}function_calls>"
CALLS_END = f"</{DSML}function_calls>"
INVOKE_END = f"</{DSML}invoke>"
INVOKE_START = f'<{DSML}invoke name="'
PARAMETER_START = f'<{DSML}parameter name="'
PARAMETER_END = f"</{DSML}parameter>"
_INVOKE = re.compile(re.escape(INVOKE_START) + r'([^"]*)">')
_PARAMETER = re.compile(
    re.escape(PARAMETER_START) + r'([^"]*)" string="(true|false)">(.*?)' + re.escape(PARAMETER_END), re.DOTALL)
_CALLS_PREFIX = "\n\n"  # what the format puts between the reply text and the calls block


@dataclass
class CallDelta:
    """What one feed added to tool call ``index``: its name (first delta only) and arguments text."""

    index: int
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def held_back(text: str, *markers: str) -> int:
    """Length of the longest end of text that is a proper start of one of the markers."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-size:]) and len(m) > size for m in markers):
            return size
    return 0


class OutputParser:
    """Splits one output into reasoning (thinking mode), reply text and tool calls (parse_tools)."""

    def __init__(self, thinking: bool, parse_tools: bool) -> None:
        self.parse_tools = parse_tools
        self.mode = "reasoning" if thinking else "content"  # then "calls", then "text" (the rest)
        self.buffer = ""
        self.num_calls = 0
        self.num_parameters: Optional[int] = None  # of the open call; None: no call open
        self._steps = {"reasoning": self._reasoning, "content": self._content, "calls": self._calls, "text": self._text}

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        """Parse the next piece; final: nothing follows, so what was held back is released."""
        self.buffer += text
        out = ParsedDelta()
        while self.buffer and self._steps[self.mode](out):
            pass
        if final and self.buffer:
            if self.mode == "reasoning":
                out.reasoning += self.buffer
            else:
                out.content += self.buffer
            self.buffer = ""
        return out

    def _take(self, size: int) -> str:
        taken, self.buffer = self.buffer[:size], self.buffer[size:]
        return taken

    # Each mode's step: consume what is certain, return True while it can go on.

    def _reasoning(self, out: ParsedDelta) -> bool:
        end = self.buffer.find(THINK_END)
        if end < 0:
            out.reasoning += self._take(len(self.buffer) - held_back(self.buffer, THINK_END))
            return False
        out.reasoning += self._take(end)
        self._take(len(THINK_END))
        self.mode = "content"
        return True

    def _content(self, out: ParsedDelta) -> bool:
        start = self.buffer.find(CALLS_BEGIN) if self.parse_tools else -1
        if start < 0:
            keep = held_back(self.buffer, _CALLS_PREFIX + CALLS_BEGIN, CALLS_BEGIN) if self.parse_tools else 0
            out.content += self._take(len(self.buffer) - keep)
            return False
        out.content += self._take(start).removesuffix(_CALLS_PREFIX)
        self._take(len(CALLS_BEGIN))
        self.mode = "calls"
        return True

    def _text(self, out: ParsedDelta) -> bool:
        out.content += self._take(len(self.buffer))
        return False

    def _calls(self, out: ParsedDelta) -> bool:
        self.buffer = self.buffer.lstrip()
        buffer = self.buffer
        if buffer.startswith(CALLS_END) and self.num_parameters is None:
            self._take(len(CALLS_END))
            self.mode = "text"
        elif buffer.startswith(INVOKE_END) and self.num_parameters is not None:
            self._add_arguments(out, "}" if self.num_parameters else "{}")
            self.num_parameters = None
            self._take(len(INVOKE_END))
        elif (match := _INVOKE.match(buffer)) and self.num_parameters is None:
            out.calls.append(CallDelta(self.num_calls, name=match[1]))
            self.num_calls += 1
            self.num_parameters = 0
            self._take(match.end())
        elif (match := _PARAMETER.match(buffer)) and self.num_parameters is not None:
            key, is_string, value = match.groups()
            separator = ", " if self.num_parameters else "{"
            name = json.dumps(key, ensure_ascii=False)
            self._add_arguments(out, f"{separator}{name}: {_json_value(value, is_string)}")
            self.num_parameters += 1
            self._take(match.end())
        elif _incomplete(buffer):
            return False
        else:  # not the call syntax: the rest is reply text
            self.mode = "text"
        return True

    def _add_arguments(self, out: ParsedDelta, text: str) -> None:
        index = self.num_calls - 1
        if not out.calls or out.calls[-1].index != index:
            out.calls.append(CallDelta(index))
        out.calls[-1].arguments += text


def _incomplete(buffer: str) -> bool:
    """Whether more text could still make buffer start with a call-syntax element."""
    if any(m.startswith(buffer) for m in (CALLS_END, INVOKE_END, INVOKE_START, PARAMETER_START)):
        return True
    if buffer.startswith(INVOKE_START):
        return '">' not in buffer
    return buffer.startswith(PARAMETER_START) and PARAMETER_END not in buffer


def _json_value(value: str, is_string: str) -> str:
    """A parameter's value as JSON: string="true" values are raw text; others are JSON already
    (re-encoded; one that does not parse is kept as a string, so the arguments stay valid JSON)."""
    if is_string == "false":
        try:
            return json.dumps(json.loads(value, parse_constant=_not_json), ensure_ascii=False)
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")  # Python's json reads NaN and Infinity; JSON has neither
