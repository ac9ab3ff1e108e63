"""DeepSeek-V3.2's chat format as rendered by flashdsa's template (models/chat_template.py):
roles, tools, tool calls and results, thinking; and the checkpoints that carry it."""

import json

import pytest
from transformers import AutoTokenizer

from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.models.chat_template import CHAT_TEMPLATE, apply_chat_template

BOS, EOS, D = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "｜DSML｜"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Météo",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "x": [True, None]}}}
INVOKE = (f'<{D}invoke name="get_weather">\n'
          f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
          f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
          f'<{D}parameter name="x" string="false">[true, null]</{D}parameter>\n'
          f'</{D}invoke>')


def render(tok, messages, **kwargs) -> str:
    return apply_chat_template(tok, messages, add_generation_prompt=True, **kwargs)


def test_roles_and_turns(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "dropped"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]}]
    assert render(tok, messages) == (f"{BOS}Be brief.<｜User｜>hi<｜Assistant｜></think>Hello.{EOS}"
                                     "<｜User｜>again<｜Assistant｜></think>")
    assert render(tok, messages, thinking=True) == (f"{BOS}Be brief.<｜User｜>hi<｜Assistant｜></think>Hello.{EOS}"
                                                    "<｜User｜>again<｜Assistant｜><think>")
    assert render(tok, messages[:2], enable_thinking=True).endswith("<｜Assistant｜><think>")
    developer = render(tok, [{"role": "developer", "content": "rules"}])
    assert developer == f"{BOS}<｜User｜>\n\n# The user's message is: rules<｜Assistant｜></think>"


def test_tools_calls_and_results(tok):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Checking.", "reasoning_content": "need it", "tool_calls": [CALL, CALL]},
                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"}]
    text = render(tok, messages, tools=[TOOL], thinking=True)
    tools_end = '<functions>\n{"name": "get_weather", "description": "Météo", "parameters": {"type": "object", ' \
                '"properties": {"city": {"type": "string"}}}}\n</functions>\n'
    head, tail = text.split(tools_end)
    assert head.startswith(f"{BOS}\n\n## Tools\nYou have access to a set of tools")
    assert f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>' in head
    calls = f"\n\n<{D}function_calls>\n{INVOKE}\n{INVOKE}\n</{D}function_calls>"
    assert tail == ("<｜User｜>weather?<｜Assistant｜><think>need it</think>Checking." + calls + EOS
                    + "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>"
                    + "\n</function_results>\n\n<think>")
    without_thinking = render(tok, messages[:3] + [{"role": "tool", "content": "rain"}])
    assert without_thinking.endswith("</function_results>\n\n</think>") and "need it" not in without_thinking


def test_bad_conversations_are_refused(tok):
    with pytest.raises(Exception, match="must answer a tool call"):
        render(tok, [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
    string_arguments = dict(CALL, function={"name": "f", "arguments": json.dumps({"a": 1})})
    with pytest.raises(Exception, match="mapping"):
        render(tok, [{"role": "assistant", "content": "", "tool_calls": [string_arguments]}])


def test_checkpoints_carry_the_template(tok, tmp_path):
    assert tok.chat_template == CHAT_TEMPLATE  # the tiny checkpoints' tokenizer
    default = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    assert default.chat_template == CHAT_TEMPLATE
    assert render(default, [{"role": "user", "content": "hi"}]) == "<|bos|><｜User｜>hi<｜Assistant｜></think>"
    default.chat_template = None  # as DeepSeek-V3.2's own tokenizer, which ships no template
    assert render(default, [{"role": "user", "content": "hi"}]) == "<|bos|><｜User｜>hi<｜Assistant｜></think>"
