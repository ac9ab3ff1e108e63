"""Structured outputs, tool calls and reasoning through the OpenAI API, end to end on CPU: the
shipped default model for grammars and reasoning, a tiny checkpoint (whose tokenizer, like
DeepSeek-V3.2's, has the DSML marker as a special token) for tool calls. The models write
gibberish, so the grammar is what makes the output parse."""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_thread import ServerThread
from test_structured import SCHEMA, matches_schema
from transformers import AutoTokenizer

from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.models.loader import load_model
from flashdsa.runtime.engine import EngineConfig
from flashdsa.serve.command import make_app
from flashdsa.serve.protocol import ChatCompletionRequest
from flashdsa.serve.tools import chat_params

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def serve(model_dir, mode: str, max_model_len: int):
    model, tokenizer = load_model(model_dir, mode=mode), AutoTokenizer.from_pretrained(str(model_dir))
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, num_blocks=96, max_model_len=max_model_len)
    with ServerThread(make_app(model, tokenizer, "m", config)) as server:
        server.engine = server.server.config.app.state.server.llm.engine
        yield server
        assert server.engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def default_server():
    yield from serve(DEFAULT_MODEL, "reference", 1024)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from flashdsa.models.tiny import make_tiny_checkpoint

    yield from serve(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), shrink=True), "reference", 2048)


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def greedy(**extra) -> dict:
    return {"model": "m", "temperature": 0, **extra}


def test_json_schema_holds_on_chat_and_completions(default_server):
    client = client_of(default_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def streamed_json_object() -> str:  # a small object: json_object alone lets the model ramble past max_tokens
        small = {"type": "json_schema", "json_schema": {"name": "flag", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            messages=ASK, response_format=small, max_tokens=200, stream=True, **greedy()) if c.choices)

    with ThreadPoolExecutor(3) as pool:  # one batch
        chat = pool.submit(client.chat.completions.create, messages=ASK, response_format=fmt, max_tokens=200, **greedy())
        text = pool.submit(client.completions.create, prompt="ROMEO:", max_tokens=200,
                           extra_body={"guided_json": SCHEMA}, **greedy())
        streamed = pool.submit(streamed_json_object)
    chat, text = chat.result().choices[0], text.result().choices[0]
    assert matches_schema(json.loads(chat.message.content)) and chat.finish_reason == "stop"
    assert matches_schema(json.loads(text.text)) and text.finish_reason == "stop"
    assert isinstance(json.loads(streamed.result()), (dict, list))


def test_choice_and_regex(default_server):
    client = client_of(default_server)
    choices = ["yes", "no", "never again"]
    chat = client.chat.completions.create(model="m", messages=ASK, n=4, temperature=1.2, seed=5, max_tokens=20,
                                          extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in chat.choices)
    text = client.completions.create(prompt="ROMEO:", max_tokens=30, extra_body={"guided_regex": r"[A-Z]{2}-\d{3}"},
                                     **greedy())
    assert len(text.choices[0].text) == 6 and text.choices[0].text[2] == "-"


@pytest.mark.parametrize("route, body, param", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"guided_json": "{oops"}, "guided_json"),
    ("completions", {"guided_regex": "(a"}, "guided_regex"),
    ("completions", {"guided_grammar": "root ::= nothing"}, "guided_grammar"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    ("completions", {"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
    ("chat", {"guided_choice": ["a"], "min_tokens": 2}, "guided_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required", "guided_choice": ["a"]}, "tool_choice"),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": 'bad"name'}}]}, "tools[0].function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wizard"}}}],
              "tool_choice": "required"}, "tools"),
    ("chat", {"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_grammars_and_tools_are_400s_naming_the_field(default_server, route, body, param):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    base = {"model": "m", "max_tokens": 4, **({"messages": ASK} if route == "chat" else {"prompt": "x"})}
    r = httpx.post(default_server.url + path, json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_thinking_returns_reasoning_content(default_server):
    client = client_of(default_server)
    thinking = {"chat_template_kwargs": {"thinking": True}}
    full = client.chat.completions.create(messages=ASK, max_tokens=8, extra_body=thinking, **greedy()).choices[0]
    reasoning = full.message.model_extra["reasoning_content"]
    assert len(reasoning) > 0 and full.message.content == ""  # the model never closed its reasoning
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        messages=ASK, max_tokens=8, stream=True, extra_body=thinking, **greedy()) if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    plain = client.chat.completions.create(messages=ASK, max_tokens=8, **greedy()).choices[0].message
    assert "reasoning_content" not in (plain.model_extra or {})


@pytest.mark.parametrize("fields, keeps_special_tokens", [
    ({}, False), ({"tools": [WEATHER]}, True), ({"tools": [WEATHER], "tool_choice": "none"}, False),
    ({"chat_template_kwargs": {"thinking": True}}, True), ({"chat_template_kwargs": {"enable_thinking": True}}, True),
])
def test_tool_and_reasoning_requests_keep_special_tokens(default_server, fields, keeps_special_tokens):
    body = ChatCompletionRequest(model="m", messages=ASK, **fields)
    params = asyncio.run(chat_params(default_server.engine, body, body.sampling_params(None, None)))
    assert params.skip_special_tokens is not keeps_special_tokens
    assert (body.prompt_tools() is not None) is ("tools" in fields and "tool_choice" not in fields)


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "now":
        assert arguments == {}
    else:
        assert call.function.name == "get_weather"
        assert set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome")
        assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 9


def test_tool_choice_required_yields_a_valid_call(tiny_server):
    client = client_of(tiny_server)
    reply = client.chat.completions.create(messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=400, **greedy()).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    [call] = reply.message.tool_calls
    check_call(call)


def test_named_tool_call_streams_as_it_returns(tiny_server):
    client = client_of(tiny_server)
    request = dict(messages=ASK, tools=[CLOCK, WEATHER], max_tokens=400,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}}, **greedy())

    def streamed() -> tuple[dict, str]:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **request):
            for part in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return calls, finish

    with ThreadPoolExecutor(2) as pool:  # one batch
        whole, stream = pool.submit(client.chat.completions.create, **request), pool.submit(streamed)
    [call] = whole.result().choices[0].message.tool_calls
    check_call(call)
    assert stream.result() == ({0: {"name": "get_weather", "arguments": call.function.arguments}}, "tool_calls")


def test_tool_results_come_back_into_the_prompt(tiny_server):
    client = client_of(tiny_server)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(messages=messages, tools=[WEATHER], max_tokens=4, **greedy())
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    tokens = httpx.post(tiny_server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = AutoTokenizer.from_pretrained(str(tiny_server.engine.tokenizer.name_or_path)).decode(tokens)
    assert '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>' in text
    assert text.endswith("<function_results>\n<result>sunny</result>\n</function_results>\n\n</think>")
