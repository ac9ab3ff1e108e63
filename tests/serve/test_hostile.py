"""The default model on CPU (reference mode) behind a real uvicorn on 127.0.0.1, under
(1) a fuzz of hostile requests: every answer is a 2xx or a 4xx in the OpenAI schema, nothing
fails, and afterwards a valid request works and every cache block is free again; and (2) a load
of concurrent requests of which a third disconnect at random: the ones that finish give exactly
the text they give alone, and every block comes back."""

import asyncio
import json
import random

import httpx
import pytest
from server_thread import ServerThread, metric, wait_until_idle

from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.runtime.engine import EngineConfig
from flashdsa.serve.command import make_app

NUM_BLOCKS = 64
CONCURRENCY = 16


@pytest.fixture(scope="module")
def server():
    from transformers import AutoTokenizer

    from flashdsa.models.loader import load_model

    model = load_model(DEFAULT_MODEL, mode="reference")
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=1024, num_blocks=NUM_BLOCKS)
    app = make_app(model, tokenizer, "default", config, max_queued=128)
    with ServerThread(app) as s:
        yield s


BAD_VALUES = [None, True, -1, 0, 2**63, 2**64, -(2**63) - 1, 1e308, 1e-320, float("nan"), float("inf"),
              -float("inf"), "x", "", "\ud800", [], [1], {}, {"a": 1}, [None], ["\udfff"]]
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "logprobs", "stop", "stop_token_ids",
          "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "best_of",
          "echo", "stream", "ignore_eos", "skip_special_tokens", "stream_options", "prompt", "model", "user"]
CHAT_FIELDS = ["messages", "max_completion_tokens", "top_logprobs", "logprobs", "add_generation_prompt",
               "continue_final_message", "temperature", "n", "stop"]
GENERATING = [  # valid but extreme: each must generate (or be refused), never fail
    {"top_k": 2**63 - 1}, {"temperature": 1e-30}, {"temperature": 1e30}, {"top_p": 1e-300}, {"min_p": 1.0},
    {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300}, {"presence_penalty": 2, "frequency_penalty": -2},
    {"seed": 2**63 - 1, "n": 3}, {"logit_bias": {str(t): 100 for t in range(0, 2048, 7)}},
    {"logit_bias": {"1": 100}, "min_tokens": 2}, {"logit_bias": {"1": -100, "0": 100}, "skip_special_tokens": False},
    {"stop": ["", "\u0000", "e", "\U0001F600"]}, {"stop_token_ids": list(range(2048))}, {"echo": True, "logprobs": 20},
    {"echo": True, "max_tokens": 0, "logprobs": 20}, {"include_stop_str_in_output": True, "stop": [" "]},
    {"prompt": "\u202e\u200b\u0000<|eos|><|bos|>"}, {"prompt": [0] * 50}, {"prompt": [2047, 0, 1]},
    {"prompt": ["a", [5, 6], "b"]}, {"n": 4, "best_of": 6}, {"logprobs": 20, "n": 2}, {"ignore_eos": True},
    {"stream": True, "stream_options": {"include_usage": True}, "n": 2},
    {"response_format": {"type": "json_object"}}, {"guided_choice": ["yes", "no"]}, {"guided_regex": "[a-z]+"},
]
BAD_GRAMMARS = [  # each a 400 naming its field
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
    {"response_format": {"type": "json_schema"}}, {"guided_regex": "("}, {"guided_choice": []},
    {"guided_json": "{not json"}, {"guided_grammar": "root ::= ("}, {"guided_regex": "a", "guided_choice": ["a"]},
    {"guided_choice": ["a"], "min_tokens": 1}, {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
    {"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "absent"}}},
    {"chat_template_kwargs": {"tokenize": True}},
]


def hostile_requests() -> list[tuple[str, bytes]]:
    rng = random.Random(0)
    cases = [(route, body) for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
             for body in (b"", b"{", b"[]", b"null", b"1", b'"s"', b'{"prompt": "x",}', b"[" * 5000 + b"]" * 5000,
                          b'{"prompt": "\\ud800"}', b"\xff\xfe", json.dumps({"prompt": "x" * (5 * 2**20)}).encode())]
    base = {"prompt": "ROMEO:", "max_tokens": 2}
    unbounded = (None, 1e308, 2**63, 2**64)  # a length up to the context is no attack, just slow on CPU
    for field in FIELDS:
        cases += [("/v1/completions", json.dumps({**base, field: v}).encode()) for v in BAD_VALUES
                  if field != "max_tokens" or v not in unbounded]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field in CHAT_FIELDS:
        cases += [("/v1/chat/completions", json.dumps({**chat, field: v}).encode()) for v in BAD_VALUES]
    for messages in ([{"role": "wizard", "content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                     [{"role": "user"}] * 300, [{"role": "user", "content": {"a": 1}}], [[]]):
        cases.append(("/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": 2}).encode()))
    for extreme in GENERATING:
        cases.append(("/v1/completions", json.dumps({**base, **extreme}).encode()))
        cases.append(("/v1/chat/completions", json.dumps({**chat, **{k: v for k, v in extreme.items()
                                                                     if k not in ("prompt", "echo", "best_of")}}).encode()))
    for grammar in BAD_GRAMMARS:
        cases.append(("/v1/chat/completions", json.dumps({**chat, **grammar}).encode()))
    for _ in range(40):  # random mixes of good and bad fields
        body = dict(base)
        for field in rng.sample([f for f in FIELDS if f != "max_tokens"], 3):
            body[field] = rng.choice(BAD_VALUES + [1, 2, 0.5])
        cases.append(("/v1/completions", json.dumps(body).encode()))
    cases += [("/v1/completions", json.dumps({**base, "n": 100_000}).encode()),
              ("/v1/completions", json.dumps({**base, "stop": ["x"] * 100_000}).encode()),
              ("/v1/completions", json.dumps({**base, "prompt": [7] * 1000, "n": 100, "echo": True, "logprobs": 20}).encode()),
              ("/v1/completions", json.dumps({**base, "prompt": list(range(2048)) * 40}).encode()),
              ("/tokenize", json.dumps({"prompt": "ROMEO: " * 100_000}).encode()),
              ("/detokenize", json.dumps({"tokens": [5] * 200_000}).encode()),
              ("/detokenize", json.dumps({"tokens": [2**40]}).encode())]
    return cases


async def send_all(url: str, cases: list[tuple[str, bytes]]) -> list[tuple[str, bytes, int, str]]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(route: str, body: bytes):
            async with semaphore:
                r = await client.post(route, content=body, headers={"Content-Type": "application/json"})
                return route, body, r.status_code, r.text
        return await asyncio.gather(*(one(route, body) for route, body in cases))


def test_a_fuzz_of_hostile_requests_hurts_nothing(server):
    free_before = metric(server, "num_blocks_free")
    cases = hostile_requests()
    assert len(cases) >= 500
    for route, body, status, text in asyncio.run(send_all(server.url, cases)):
        assert status < 500, (route, body[:200], status, text[:500])
        if status >= 400:
            error = json.loads(text)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, text[:500]
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    wait_until_idle(server)
    assert metric(server, "num_blocks_free") == free_before == NUM_BLOCKS
    assert metric(server, "request_failed_total") == 0


LOAD_PROMPTS = ["ROMEO:", "JULIET: O Romeo", "First Citizen:\nBefore we proceed", "KING HENRY:"]


def load_body(i: int) -> tuple[str, dict]:
    stream = i % 2 == 0
    if i % 3 == 0:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": LOAD_PROMPTS[i % 4]}],
                                        "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    return "/v1/completions", {"prompt": LOAD_PROMPTS[i % 4], "max_tokens": 12, "temperature": 0,
                               "ignore_eos": True, "stream": stream}


async def run_load(url: str, count: int, disconnect_share: float) -> list:
    rng = random.Random(1)
    semaphore = asyncio.Semaphore(24)

    async def one(client: httpx.AsyncClient, i: int):
        route, body = load_body(i)
        async with semaphore:
            if body["stream"]:
                text = ""
                async with client.stream("POST", route, json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            choice = json.loads(line[6:])["choices"]
                            text += (choice[0].get("text") or choice[0].get("delta", {}).get("content") or "") if choice else ""
                return i, text
            r = await client.post(route, json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return i, choice.get("text", choice.get("message", {}).get("content"))

    async def maybe_cut(client, i):
        task = asyncio.create_task(one(client, i))
        if rng.random() < disconnect_share:
            await asyncio.sleep(rng.uniform(0.0, 0.4))
            task.cancel()  # closes the connection: the server must abort and free the blocks
        try:
            return await task
        except asyncio.CancelledError:
            return i, None

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.wait_for(asyncio.gather(*(maybe_cut(client, i) for i in range(count))), timeout=120)


def test_load_with_random_disconnects_keeps_outputs_exact_and_frees_every_block(server):
    aborted_before = metric(server, "request_aborted_total")
    results = asyncio.run(run_load(server.url, 150, 0.3))
    finished = {i: text for i, text in results if text is not None}
    assert 60 <= len(finished) < 150
    alone = {}  # the text of each request shape (route, prompt; streamed or not), sent alone after the load
    for i, text in finished.items():
        route, body = load_body(i)
        shape = (route, json.dumps({k: v for k, v in body.items() if k != "stream"}))
        if shape not in alone:
            reply = httpx.post(server.url + route, json={**body, "stream": False}, timeout=60).json()["choices"][0]
            alone[shape] = reply.get("text", reply.get("message", {}).get("content"))
        assert text == alone[shape], (i, text, alone[shape])
    wait_until_idle(server)
    assert metric(server, "request_aborted_total") > aborted_before
    assert metric(server, "num_blocks_free") == NUM_BLOCKS
    assert metric(server, "request_failed_total") == 0
