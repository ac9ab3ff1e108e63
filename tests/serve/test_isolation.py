"""No request can hurt another: failures stay with their request (error event + [DONE] when
streaming, a 500 that keeps the connection otherwise), and the server keeps serving. A fake
model that fails every forward whose input holds token POISON, behind a real uvicorn."""

import http.client
import json

import httpx
import pytest
from fake_model import POISON, FailsOnPoison, reference_greedy
from server_thread import ServerThread, metric, wait_until_idle

from flashdsa.runtime.engine import EngineConfig
from flashdsa.serve.command import make_app

class BreakingTokenizer:
    """The tiny tokenizer, except that encoding "boom" raises an unexpected error."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, **kwargs):
        if text == "boom":
            raise RuntimeError("tokenizer bug")
        return self.tok.encode(text, **kwargs)


@pytest.fixture(scope="module")
def server(tok):
    app = make_app(FailsOnPoison(len(tok)), BreakingTokenizer(tok), "fake", EngineConfig(num_blocks=32), max_queued=8)
    with ServerThread(app) as s:
        yield s
        wait_until_idle(s)
        assert s.engine.block_manager.num_used_blocks == 0


def poisoned(**extra) -> dict:
    """A request whose first sampled token is POISON, so the next forward fails."""
    return {"prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0, "logit_bias": {str(POISON): 100}, **extra}


def sse_events(response: httpx.Response) -> list:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_a_stream_that_fails_ends_with_an_error_event_and_done(server):
    failed_before = metric(server, "request_failed_total")
    with httpx.stream("POST", server.url + "/v1/completions", json=poisoned(stream=True), timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    first, error = json.loads(events[0]), json.loads(events[-2])
    assert first["choices"][0]["text"] is not None
    assert error["error"]["code"] == 500 and "poisoned input" in error["error"]["message"]
    assert metric(server, "request_failed_total") == failed_before + 1


def test_a_failing_request_gets_a_500_and_the_connection_stays_open(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    for body in (poisoned(), {"prompt": "boom"}, {"prompt": "fine", "max_tokens": 2}):
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        sock = conn.sock
        response = conn.getresponse()
        payload = json.loads(response.read())
        if body.get("prompt") == "fine":
            assert response.status == 200
        else:
            assert response.status == 500 and set(payload["error"]) == {"message", "type", "param", "code"}
        assert response.getheader("connection") != "close"
        assert conn.sock is sock  # the same keep-alive connection serves the next request
    conn.close()


def test_a_failing_request_does_not_touch_the_others_in_its_step(tok):
    """The engine retries a failed forward one request at a time: the healthy requests batched
    with the poisoned one give exactly the text they give alone."""
    from flashdsa.runtime.engine import LLMEngine
    from flashdsa.runtime.sampling_params import SamplingParams

    engine = LLMEngine(FailsOnPoison(len(tok)), tok, EngineConfig(num_blocks=16))
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", [5, 6], good)
    engine.add_request("bad", [POISON, 5], SamplingParams(max_tokens=8))
    engine.add_request("b", [7, 8, 9], good)
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs["bad"][-1].finish_reason == "error" and len(outputs["bad"]) == 1
    for rid, prompt in (("a", [5, 6]), ("b", [7, 8, 9])):
        assert [t for o in outputs[rid] for t in o.new_token_ids] == reference_greedy(prompt, len(tok), 8, eos=-1)
    assert engine.num_failed == 1 and engine.block_manager.num_used_blocks == 0
