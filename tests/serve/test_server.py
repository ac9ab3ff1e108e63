"""The OpenAI-compatible server end to end: the tiny shrunk checkpoint (reference mode, CPU)
behind a real uvicorn on 127.0.0.1, driven by the official openai client."""

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_thread import ServerThread, metric, wait_until_idle

from flashdsa.runtime.engine import EngineConfig
from flashdsa.serve.command import make_app

KEY = "test-key"
MODEL = "tiny"
SYSTEM = "You are a helpful assistant. " * 12  # > 64 tokens: at least one full shared block


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, num_blocks=48, max_model_len=512)
    app = make_app(model, tokenizer, MODEL, config, max_queued=64, api_key=KEY)
    with ServerThread(app) as s:
        yield s
        wait_until_idle(s)
        assert s.engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy(**extra):
    return {"model": MODEL, "temperature": 0, "max_tokens": 6, **extra}


def test_models_and_bearer_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_streaming_equals_non_streaming_with_usage(client):
    full = client.completions.create(prompt="The quick brown fox", **greedy())
    assert full.usage.completion_tokens == 6 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(prompt="The quick brown fox", stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompts_echo_and_logprobs(client, tiny):
    tokenizer = tiny[1]
    ids = tokenizer.encode("Hello! How are you")
    by_ids = client.completions.create(prompt=ids, **greedy())
    by_text = client.completions.create(prompt="Hello! How are you", **greedy())
    assert by_ids.choices[0].text == by_text.choices[0].text
    echo = client.completions.create(prompt="Hello! How are you", echo=True, logprobs=2, **greedy())
    choice = echo.choices[0]
    assert choice.text == "Hello! How are you" + by_text.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 6 and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])  # equal texts merge
    # greedy picks the most likely token: its logprob is the top one
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-5)


def test_chat_streaming_n2_and_logprobs(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(messages=messages, n=2, logprobs=True, top_logprobs=3, **greedy())
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].message.content == full.choices[1].message.content  # greedy
    assert len(full.choices[0].logprobs.content) == 6 and len(full.choices[0].logprobs.content[0].top_logprobs) == 3
    assert full.usage.completion_tokens == 12
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.chat.completions.create(messages=messages, n=2, stream=True,
                                                stream_options={"include_usage": True}, **greedy()):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert texts[0] == texts[1] == full.choices[0].message.content
    assert usage.completion_tokens == 12


def test_stop_string_and_max_completion_tokens(client):
    base = client.completions.create(prompt="Once upon a time", **greedy(max_tokens=12)).choices[0].text
    assert len(base) > 4
    stop = base[2:4]
    stopped = client.completions.create(prompt="Once upon a time", stop=[stop], **greedy(max_tokens=12)).choices[0]
    assert stopped.text == base[: base.index(stop)] and stopped.finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=3, temperature=0)
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


def test_seed_reproducibility(client):
    def run(seed):
        return client.completions.create(model=MODEL, prompt="Rain falls", max_tokens=8, temperature=1.0,
                                         seed=seed, n=2).choices
    first, again, other = run(7), run(7), run(8)
    assert [c.text for c in first] == [c.text for c in again]
    assert [c.text for c in first] != [c.text for c in other]


def test_32_concurrent_streams_give_the_one_at_a_time_greedy_text(server, client):
    prompts = ["The sea is wide", "def add(a, b):", "Where is the library?", "one, two, three"]
    alone = [client.completions.create(prompt=p, **greedy()).choices[0].text for p in prompts]

    async def stream(aclient, prompt):
        text = ""
        async for chunk in await aclient.completions.create(prompt=prompt, stream=True, **greedy()):
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(stream(aclient, prompts[i % 4]) for i in range(32)))

    together = asyncio.run(all_at_once())
    assert together == [alone[i % 4] for i in range(32)]


def test_shared_system_prompt_hits_the_prefix_cache(server, client):
    before = metric(server, "prefix_cache_hits_total")
    for question in ("Who are you?", "What is two plus two?"):
        client.chat.completions.create(messages=[{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": question}], **greedy(max_tokens=2))
    assert metric(server, "prefix_cache_hits_total") - before >= 64
    reply = client.chat.completions.create(messages=[{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": "Again?"}], **greedy(max_tokens=2))
    assert reply.usage.prompt_tokens_details.cached_tokens >= 64
    prompt = SYSTEM + "Once more."
    client.completions.create(prompt=prompt, **greedy(max_tokens=2))
    again = client.completions.create(prompt=prompt, **greedy(max_tokens=2))
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "inter_token_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total"):
        assert metric(server, name) > 0


BAD_BODIES = [
    b"{not json",
    b"[1, 2]",
    json.dumps({"model": MODEL}),
    json.dumps({"model": MODEL, "prompt": 5}),
    json.dumps({"model": MODEL, "prompt": []}),
    json.dumps({"model": MODEL, "prompt": [[]]}),
    json.dumps({"model": MODEL, "prompt": [-1, 3]}),
    json.dumps({"model": MODEL, "prompt": [10**9]}),
    json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1}),
    json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}),
    json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 10**12}),
    json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "many"}),
    json.dumps({"model": MODEL, "prompt": "hi", "temperature": -0.5}),
    json.dumps({"model": MODEL, "prompt": "hi", "temperature": "hot"}),
    json.dumps({"model": MODEL, "prompt": "hi", "top_p": 0}),
    json.dumps({"model": MODEL, "prompt": "hi", "top_k": -7}),
    json.dumps({"model": MODEL, "prompt": "hi", "n": 0}),
    json.dumps({"model": MODEL, "prompt": "hi", "n": 10**6}),
    json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 50}),
    json.dumps({"model": MODEL, "prompt": "hi", "seed": -3}),
    json.dumps({"model": MODEL, "prompt": "hi", "stop": 7}),
    json.dumps({"model": MODEL, "prompt": "hi", "presence_penalty": 9}),
    json.dumps({"model": MODEL, "prompt": "hi", "stream": "maybe"}),
    json.dumps({"model": "no-such-model", "prompt": "hi"}),
    json.dumps({"model": MODEL, "prompt": "word " * 2000}),
]
BAD_CHAT_BODIES = [
    json.dumps({"model": MODEL, "messages": []}),
    json.dumps({"model": MODEL, "messages": "hello"}),
    json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
    json.dumps({"model": MODEL, "messages": [{"content": "hi"}]}),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -2}),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}),
    json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),
]


def test_fuzz_of_bad_requests_is_answered_4xx_and_the_server_stays_healthy(server, client):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [("/v1/completions", b) for b in BAD_BODIES] + [("/v1/chat/completions", b) for b in BAD_CHAT_BODIES]
    cases += [("/tokenize", json.dumps({"prompt": 3})), ("/detokenize", json.dumps({"tokens": [-5]})),
              ("/v1/nothing", "{}")]
    for route, body in cases:
        r = httpx.post(server.url + route, content=body, headers=headers)
        assert 400 <= r.status_code < 500, (route, body, r.status_code, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (route, body)
    r = httpx.post(server.url + "/v1/completions", content=BAD_BODIES[-2], headers=headers)
    assert r.status_code == 404
    assert httpx.get(server.url + "/health").status_code == 200
    assert client.completions.create(prompt="still there?", **greedy()).usage.completion_tokens == 6


def test_tokenize_round_trip_needs_the_key(server, tiny):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Hello there", "add_special_tokens": False}
    tokens = httpx.post(server.url + "/tokenize", json=body, headers=auth).json()
    assert tokens["tokens"] == tiny[1].encode("Hello there", add_special_tokens=False)
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()["prompt"]
    assert text == "Hello there"
    for route, payload in (("/tokenize", body), ("/detokenize", {"tokens": tokens["tokens"]})):
        assert httpx.post(server.url + route, json=payload).status_code == 401


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = metric(server, "generation_tokens_total")
    body = {"model": MODEL, "prompt": "Please write a short poem", "max_tokens": 400, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_until_idle(server)
    assert metric(server, "num_blocks_used") == 0
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    wait_until_idle(server)
    assert metric(server, "num_blocks_used") == 0
    assert metric(server, "generation_tokens_total") < before + 300  # both stopped well before 400 tokens


def test_zero_blocks_in_use_after_everything(server):
    wait_until_idle(server)
    assert metric(server, "num_blocks_used") == 0
    assert server.engine.block_manager.num_used_blocks == 0


def test_full_queue_answers_503_and_recovers(tiny):
    model, tokenizer = tiny
    app = make_app(model, tokenizer, MODEL, EngineConfig(max_num_seqs=1, num_blocks=8), max_queued=0)
    body = {"model": MODEL, "prompt": "Rain falls", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with ServerThread(app) as s:
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # keep the iterator: dropping it closes the response
            assert next(lines).startswith("data: ")
            busy = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == 503
        wait_until_idle(s)
        again = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert again.status_code == 200
        assert s.engine.block_manager.num_used_blocks == 0


def test_flashdsa_serve_command_starts_serves_and_stops(tiny_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "flashdsa.cli", "serve", "--model", str(tiny_path), "--port", str(port),
               "--device", "cpu", "--mode", "reference", "--num-blocks", "8", "--api-key", KEY,
               "--served-model-name", MODEL]
    process = subprocess.Popen(command)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "flashdsa serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        assert client.completions.create(prompt="hi", **greedy(max_tokens=3)).usage.completion_tokens == 3
    finally:
        process.terminate()
        assert process.wait(timeout=30) is not None
