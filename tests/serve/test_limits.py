"""Caps that keep one request from taking what the others need: body size (413), choices, stop
strings, logprob volume, places in flight (exact 503), and an event loop that large inputs never
stall. The tiny shrunk checkpoint (reference mode, CPU) behind a real uvicorn."""

import asyncio
import threading
import time

import httpx
import pytest
from server_thread import ServerThread, metric, wait_until_idle

from flashdsa.runtime.engine import EngineConfig
from flashdsa.serve.command import make_app
from flashdsa.serve.limits import RequestLimits

KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 2 * 2**20


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    limits = RequestLimits(max_request_bytes=MAX_BYTES, max_n=8, max_stop=4, max_logprob_entries=5000)
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, num_blocks=16, max_model_len=512)
    app = make_app(model, tokenizer, "tiny", config, max_queued=2, api_key=KEY, limits=limits)
    with ServerThread(app) as s:
        yield s
        wait_until_idle(s)
        assert s.engine.block_manager.num_used_blocks == 0


def completion(server, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"max_tokens": 2, **body}, headers=AUTH, timeout=60, **kwargs)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "n": 9}, "n"),
    ({"prompt": "hi", "best_of": 9}, "n"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi " * 100, "echo": True, "logprobs": 20, "n": 3}, "logprobs"),  # 3 x ~300 x 21 entries
    ({"prompt": ["hi"] * 5, "n": 2}, None),  # 10 sequences can never fit 1 running + 2 queued
])
def test_caps_are_a_400(server, body, param):
    r = completion(server, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_body_over_the_limit_is_a_413_in_the_openai_schema(server):
    r = completion(server, {"prompt": "x" * MAX_BYTES})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert completion(server, {"prompt": "hi"}).status_code == 200


def test_an_unauthenticated_body_is_refused_before_it_is_read(server):
    started = time.monotonic()
    r = httpx.post(server.url + "/tokenize", json={"prompt": "word " * 300_000}, timeout=60)
    assert r.status_code == 401 and time.monotonic() - started < 1.0


def test_health_answers_while_a_large_prompt_is_tokenized(server):
    """Tokenizing ~1.5 MB takes seconds; the event loop must keep serving meanwhile."""
    done = threading.Event()
    tokenize_s = []

    def tokenize():
        started = time.monotonic()
        r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there, how are you? " * 60_000}, headers=AUTH,
                       timeout=120)
        tokenize_s.append(time.monotonic() - started)
        assert r.status_code == 200
        done.set()

    thread = threading.Thread(target=tokenize)
    thread.start()
    time.sleep(0.3)  # the body is in and being tokenized
    worst = 0.0
    while not done.is_set():
        started = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.05)
    thread.join()
    assert tokenize_s[0] > 1.0, "the prompt was tokenized too fast to show a stall"
    assert worst < tokenize_s[0] / 4, f"/health took {worst:.2f} s while tokenizing ({tokenize_s[0]:.2f} s)"


def test_places_in_flight_are_exact_and_the_503_says_why(server):
    """1 running + 2 queued places: of a burst of 24 streams, exactly 3 are taken."""
    body = {"prompt": "Rain falls", "max_tokens": 300, "ignore_eos": True, "stream": True}

    async def burst():
        answered, everyone = [0], asyncio.Event()  # accepted streams hold their places until all 24 are answered

        def count() -> None:
            answered[0] += 1
            if answered[0] == 24:
                everyone.set()

        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            async def one():
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    count()
                    if r.status_code == 200:
                        await r.aiter_lines().__anext__()
                        await asyncio.wait_for(everyone.wait(), 60)
                        return 200, ""
                    return r.status_code, (await r.aread()).decode()
            return await asyncio.gather(*(one() for _ in range(24)))

    results = asyncio.run(burst())
    assert sorted(status for status, _ in results) == [200] * 3 + [503] * 21
    message = next(text for status, text in results if status == 503)
    assert "3 of its 3 sequence places" in message and "max_queued 2" in message
    wait_until_idle(server)
    assert metric(server, "request_aborted_total") >= 3
    assert metric(server, "num_blocks_free") == metric(server, "num_blocks_total") == 16
