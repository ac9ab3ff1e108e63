"""A real uvicorn server on 127.0.0.1 (free port) in a background thread, stopped on exit, and
readers of its /metrics."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

START_TIMEOUT_S = 30


class ServerThread:
    def __init__(self, app) -> None:
        self.app = app
        self.engine = app.state.server.llm.engine
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def metric(server: ServerThread, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith(f"flashdsa:{name} ")]
    return float(lines[0].split()[1])


def wait_until_idle(server: ServerThread, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(server, "num_requests_running") + metric(server, "num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
