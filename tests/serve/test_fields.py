"""Every OpenAI field is honoured or refused with a 400 that names it: the tiny shrunk
checkpoint (reference mode, CPU) behind a real uvicorn."""

import json

import httpx
import pytest
from server_thread import ServerThread, wait_until_idle

from flashdsa.runtime.engine import EngineConfig
from flashdsa.runtime.sampling_params import generation_defaults
from flashdsa.serve.command import make_app

MODEL = "tiny"
DEFAULT_MAX_TOKENS = 7  # the server's sampling default (as from generation_config.json)


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, num_blocks=48, max_model_len=512)
    app = make_app(model, tokenizer, MODEL, config, sampling_defaults={"max_tokens": DEFAULT_MAX_TOKENS})
    with ServerThread(app) as s:
        yield s
        wait_until_idle(s)
        assert s.engine.block_manager.num_used_blocks == 0


def post(server, route: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(server.url + route, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def complete(server, **fields) -> dict:
    r = post(server, "/v1/completions", {"prompt": "The sea", "temperature": 0, "max_tokens": 4, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def assert_400(response: httpx.Response, param) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def chat(content: str = "hi", **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


@pytest.mark.parametrize("field,value", [("suffix", "x"), ("prediction", {"type": "content"}), ("foo_bar", 1),
                                         ("allowed_token_ids", [5])])
def test_fields_the_server_does_not_implement_are_refused_by_name(server, field, value):
    assert_400(post(server, "/v1/completions", {"prompt": "hi", field: value}), field)
    assert_400(post(server, "/v1/chat/completions", chat(**{field: value})), field)


def test_null_fields_count_as_not_given_and_user_is_accepted(server):
    complete(server, suffix=None, foo_bar=None, user="someone")
    assert_400(post(server, "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}),
               "stream_options")
    r = post(server, "/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usge": True}})
    assert_400(r, "include_usge")


def test_lone_surrogates_are_a_400_naming_the_field(server):
    cases = [
        ("/v1/completions", b'{"prompt": "RO\\ud800MEO:", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udc00"], "max_tokens": 1}', "prompt.1"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"], "max_tokens": 1}', "stop.0"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
        ("/tokenize", b'{"prompt": "RO\\ud800MEO:"}', "prompt"),
    ]
    for route, body, param in cases:
        assert_400(post(server, route, body), param)
    assert complete(server)["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**63), ("top_k", -2), ("seed", 2**64), ("n", 0), ("temperature", float("nan")),
    ("temperature", float("inf")), ("top_p", float("nan")), ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5), ("logprobs", 21), ("min_tokens", 10**30), ("max_tokens", -1),
    ("max_tokens", 2**64), ("logit_bias", {"5": 101}), ("logit_bias", {"abc": 1}), ("logit_bias", {"100000": 1}),
    ("logit_bias", {"5": float("nan")}), ("stop_token_ids", [10**6]), ("stop_token_ids", [2**64]),
])
def test_numeric_fields_are_range_checked(server, field, value):
    body = json.dumps({"prompt": "hi", field: value}).encode()  # json.dumps writes NaN and Infinity as Python reads them
    assert_400(post(server, "/v1/completions", body), field)


def test_top_k_above_the_vocabulary_keeps_every_token(server):
    assert complete(server, top_k=2**63 - 1)["choices"][0]["text"] == complete(server)["choices"][0]["text"]


@pytest.mark.parametrize("fields,param", [({"top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": -1}, "top_logprobs"),
                                          ({"max_completion_tokens": -5}, "max_completion_tokens"),
                                          ({"logit_bias": {"3": -101}}, "logit_bias"), ({"n": 10**9}, "n")])
def test_chat_fields_are_range_checked(server, fields, param):
    assert_400(post(server, "/v1/chat/completions", chat(logprobs=True, **fields)), param)


def test_max_tokens_0_is_only_for_echo(server):
    assert_400(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 0}), "max_tokens")
    assert_400(post(server, "/v1/chat/completions", chat(max_tokens=0)), "max_tokens")
    assert_400(post(server, "/v1/chat/completions", chat(max_completion_tokens=0)), "max_completion_tokens")


def test_echo_with_max_tokens_0_scores_the_prompt(server, tiny):
    ids = tiny[1].encode("Once upon a time")
    scored = complete(server, prompt="Once upon a time", echo=True, max_tokens=0, logprobs=1)
    choice = scored["choices"][0]
    assert choice["text"] == "Once upon a time" and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    generated = complete(server, prompt="Once upon a time", echo=True, max_tokens=1, logprobs=1)
    assert generated["choices"][0]["logprobs"]["token_logprobs"][: len(ids)] == lp["token_logprobs"]
    plain = complete(server, prompt=ids, echo=True, max_tokens=0)["choices"][0]
    assert plain["text"] == tiny[1].decode(ids) and plain["logprobs"] is None


def test_logit_bias_steers_every_token(server, tiny):
    tok = tiny[1]
    (z,), (y,) = tok.encode("Z", add_special_tokens=False), tok.encode("Y", add_special_tokens=False)
    assert complete(server, logit_bias={str(z): 100})["choices"][0]["text"] == "ZZZZ"
    only_y_or_z = {str(t): -100 for t in range(len(tok)) if t not in (y, z)}
    assert set(complete(server, logit_bias=only_y_or_z)["choices"][0]["text"]) <= {"Y", "Z"}
    assert complete(server, logit_bias={**only_y_or_z, str(z): -100})["choices"][0]["text"] == "YYYY"
    assert complete(server, logit_bias={**only_y_or_z, str(y): -100})["choices"][0]["text"] == "ZZZZ"


def test_skip_special_tokens_and_min_tokens(server, tiny):
    eos = tiny[1].eos_token_id
    force_eos = {"logit_bias": {str(eos): 100}}
    assert complete(server, ignore_eos=True, max_tokens=2, **force_eos)["choices"][0]["text"] == ""
    shown = complete(server, ignore_eos=True, max_tokens=2, skip_special_tokens=False, **force_eos)
    assert shown["choices"][0]["text"] == tiny[1].eos_token * 2
    stopped = complete(server, max_tokens=10, min_tokens=3, **force_eos)  # EOS is masked for 3 tokens, then wins
    assert stopped["usage"]["completion_tokens"] == 4 and stopped["choices"][0]["finish_reason"] == "stop"


def test_best_of_returns_the_most_likely_of_its_choices(server):
    sampled = dict(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    every = complete(server, n=3, logprobs=0, **sampled)["choices"]
    best = max(every, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    picked = complete(server, n=1, best_of=3, **sampled)
    assert [c["text"] for c in picked["choices"]] == [best["text"]]
    assert picked["choices"][0]["logprobs"] is None and picked["usage"]["completion_tokens"] == 15
    assert_400(post(server, "/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}), "best_of")
    assert_400(post(server, "/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}), "best_of")


def test_continue_final_message_continues_the_assistant_turn(server, tiny):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]
    text = tiny[1].apply_chat_template(messages, tokenize=False, continue_final_message=True, add_generation_prompt=False)
    assert text.endswith("Hello th")
    want = tiny[1].encode(text, add_special_tokens=False)
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    assert post(server, "/tokenize", {"messages": messages, **flags}).json()["tokens"] == want
    reply = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, **flags}).json()
    assert reply["usage"]["prompt_tokens"] == len(want)
    assert_400(post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True}),
               "continue_final_message")


def test_models_by_id(server):
    assert httpx.get(server.url + f"/v1/models/{MODEL}").json()["id"] == MODEL
    r = httpx.get(server.url + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_sampling_defaults_apply_where_the_request_is_silent(server):
    reply = post(server, "/v1/chat/completions", chat(ignore_eos=True)).json()
    assert reply["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert post(server, "/v1/chat/completions", chat(ignore_eos=True, max_tokens=2)).json()["usage"]["completion_tokens"] == 2


def test_generation_config_json_gives_the_sampling_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {}
    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 50, "do_sample": True, "bos_token_id": 0}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 50}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7.0}))
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults(tmp_path)


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "hi", "bogus": 1}]}, "bogus"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object", "strict": 1}},
     "strict"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameterz": {}}}]}, "parameterz"),
])
def test_undeclared_nested_fields_are_a_400_naming_them(server, body, field):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_a_message_may_carry_a_participant_name(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    assert r.status_code == 200, r.text
