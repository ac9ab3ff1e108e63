"""DeepSeek-V3.2 output parsing (serve/dsml.py, serve/chat_output.py) on fixed strings: reasoning,
reply text and DSML tool calls, whole and streamed in pieces cut at every awkward place."""

import json
import random

import pytest

from flashdsa.serve.chat_output import ChatChoice
from flashdsa.serve.dsml import OutputParser, held_back

D = "｜DSML｜"
WEATHER = (f'<{D}invoke name="get_weather">\n'
           f'<{D}parameter name="city" string="true">Paris, "la <b>ville</b>"\n</{D}parameter>\n'
           f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
           f'<{D}parameter name="opts" string="false">{{"units": ["c", null], "x": 1.5}}</{D}parameter>\n'
           f'</{D}invoke>')
NOW = f'<{D}invoke name="now">\n\n</{D}invoke>'
CALLS = f"\n\n<{D}function_calls>\n{WEATHER}\n{NOW}\n</{D}function_calls>"
WEATHER_ARGS = {"city": 'Paris, "la <b>ville</b>"\n', "days": 3, "opts": {"units": ["c", None], "x": 1.5}}


def run(choice: ChatChoice, pieces: list[str]) -> list[dict]:
    return [choice.add(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def merged(deltas: list[dict]) -> dict:
    """The message the deltas of one choice add up to (as an OpenAI client accumulates them)."""
    out = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for delta in deltas:
        out["reasoning_content"] += delta.get("reasoning_content", "")
        out["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = out["tool_calls"].setdefault(call["index"], {"name": None, "arguments": "", "id": None})
            if "id" in call:
                assert entry["id"] is None, "a call's id and name come once"
                entry["id"], entry["name"] = call["id"], call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    return out


def without_ids(calls: list[dict]) -> list[dict]:
    return [{key: value for key, value in call.items() if key != "id"} for call in calls]


def cuts(text: str, rng: random.Random, pieces: int) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), pieces - 1))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def test_reply_reasoning_and_calls_whole():
    text = "Let me think.\nOK</think>I will check." + CALLS
    choice = ChatChoice(thinking=True, parse_tools=True)
    run(choice, [text])
    message = choice.message()
    assert message["reasoning_content"] == "Let me think.\nOK"
    assert message["content"] == "I will check."
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == WEATHER_ARGS
    assert calls[0]["function"]["arguments"] == json.dumps(WEATHER_ARGS, ensure_ascii=False)
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert choice.finish_reason("stop") == "tool_calls" and choice.finish_reason("length") == "length"


@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_deltas_cut_anywhere_add_up_to_the_whole(thinking):
    text = ("r</thi" "nk? no: </think>" if thinking else "") + "Sure.\n\n\nDone" + CALLS
    whole = ChatChoice(thinking, parse_tools=True)
    run(whole, [text])
    expected = whole.message()
    rng = random.Random(0)
    splits = [[text[:i], text[i:]] for i in range(1, len(text))]  # every two-piece cut
    splits += [cuts(text, rng, rng.randint(3, 40)) for _ in range(200)]
    splits.append(list(text))  # one character at a time
    for pieces in splits:
        choice = ChatChoice(thinking, parse_tools=True)
        got = merged(run(choice, pieces))
        assert got["content"] == expected["content"] == "Sure.\n\n\nDone"
        assert got["reasoning_content"] == (expected["reasoning_content"] if thinking else "")
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"].values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in expected["tool_calls"]]
        assert without_ids(choice.message()["tool_calls"]) == without_ids(expected["tool_calls"])
    if thinking:
        assert expected["reasoning_content"] == "r</thi" "nk? no: "


def test_markers_are_held_back_until_they_are_whole():
    parser = OutputParser(thinking=True, parse_tools=True)
    assert parser.feed("abc</th").reasoning == "abc"
    out = parser.feed("ink>hi\n")
    assert (out.reasoning, out.content) == ("", "hi")  # "\n" may start the calls block
    out = parser.feed("\n<｜DS")
    assert out.content == ""
    out = parser.feed(f"ML｜function_calls>\n<{D}invoke name=\"now")
    assert (out.content, out.calls) == ("", [])
    out = parser.feed('">\n')
    assert [(c.index, c.name, c.arguments) for c in out.calls] == [(0, "now", "")]
    out = parser.feed(f"</{D}invoke>\n</{D}function_calls>")
    assert [(c.index, c.name, c.arguments) for c in out.calls] == [(0, None, "{}")]
    assert held_back("x</", "</think>") == 2 and held_back("x", "</think>") == 0


def test_without_thinking_or_tools_text_passes_through():
    text = "a</think>b" + CALLS
    plain = ChatChoice()
    assert run(plain, [text]) == [{"content": text}]
    assert plain.message() == {"role": "assistant", "content": text}
    no_tools = ChatChoice(thinking=True)
    run(no_tools, [text])
    assert no_tools.message() == {"role": "assistant", "content": "b" + CALLS, "reasoning_content": "a"}


def test_reasoning_without_its_end_is_all_reasoning():
    choice = ChatChoice(thinking=True, parse_tools=True)
    run(choice, ["still thinking </thi"])
    assert choice.message() == {"role": "assistant", "content": "", "reasoning_content": "still thinking </thi"}


@pytest.mark.parametrize("bad", [
    f"<{D}invoke nam='x'>",  # not the syntax
    f'<{D}parameter name="a" string="true">1</{D}parameter>',  # a parameter outside a call
    f'<{D}invoke name="x">\n<{D}parameter name="a" string="maybe">1</{D}parameter>',
])
def test_broken_call_syntax_becomes_text(bad):
    text = f"hi\n\n<{D}function_calls>\n{bad}\nrest"
    choice = ChatChoice(parse_tools=True)
    deltas = run(choice, cuts(text, random.Random(1), 6))
    message = choice.message()
    assert message["content"].startswith("hi") and message["content"].endswith("rest")
    assert merged(deltas)["content"] == message["content"]


def test_truncated_call_keeps_its_text_and_values_stay_json():
    text = (f"\n\n<{D}function_calls>\n<{D}invoke name=\"f\">\n"
            f'<{D}parameter name="a" string="false">NaN</{D}parameter>\n'
            f'<{D}parameter name="b" string="false">[1, 2</{D}parameter>\n'
            f'<{D}parameter name="c" string="true">tru')
    choice = ChatChoice(parse_tools=True)
    run(choice, [text])
    message = choice.message()
    assert json.loads(message["tool_calls"][0]["function"]["arguments"] + "}") == {"a": "NaN", "b": "[1, 2"}
    assert message["content"] == f'<{D}parameter name="c" string="true">tru'


def test_parallel_tool_calls_false_keeps_the_first_call():
    choice = ChatChoice(parse_tools=True, parallel_tool_calls=False)
    deltas = run(choice, [CALLS[:60], CALLS[60:]])
    assert [c["function"]["name"] for c in choice.message()["tool_calls"]] == ["get_weather"]
    assert all(call["index"] == 0 for d in deltas for call in d.get("tool_calls", []))
