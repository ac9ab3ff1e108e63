"""The engine behind an asyncio server: the step loop runs in its own thread.

Requests and aborts reach the loop through a thread-safe command queue; each request's outputs
come back on its own asyncio.Queue (handed over with call_soon_threadsafe). A caller that stops
iterating (a client that went away) aborts its request, which frees its blocks. Nothing a
request does can stop the loop: per-request errors end that request with an error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator, Callable, Optional

from flashdsa.runtime.engine import LLMEngine, RequestOutput
from flashdsa.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


class QueueFull(RuntimeError):
    """Raised by generate() when max_queued requests are already waiting."""


class AsyncLLM:
    """Wraps an LLMEngine; ``on_step(engine, outputs)`` runs on the engine thread after each step."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queued: int = 1024,
        on_step: Optional[Callable[[LLMEngine, list[RequestOutput]], None]] = None,
    ) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread = threading.Thread(target=self._run, name="flashdsa-engine", daemon=True)

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def check(self, prompt_token_ids: list[int], params: SamplingParams, count: int = 1) -> None:
        """Raise ValueError if the request is invalid here, QueueFull if count more do not fit."""
        self.engine.check_request(prompt_token_ids, params)
        capacity = self.engine.config.max_num_seqs + self.max_queued
        if count > capacity:
            raise ValueError(f"the request asks for {count} sequences (prompts x n); this server takes {capacity}")
        if self.num_active + count > capacity:
            raise QueueFull(f"the server is busy: {self.max_queued} requests are already queued")

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; ValueError for a bad request. Callers enforce
        the queue limit with check() first, once for all the requests they are about to add."""
        self.engine.check_request(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._post(("add", request_id, prompt_token_ids, params))
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                yield out
        finally:
            del self._streams[request_id]
            if not finished:
                self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """On the event loop: hand outputs (or errors) to their requests' queues."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)

    def _send(self, items: list[tuple[str, object]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _drain_commands(self) -> None:
        failed = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "abort":
                self.engine.abort(command[1])
                continue
            _, request_id, prompt_token_ids, params = command
            try:
                self.engine.add_request(request_id, prompt_token_ids, params)
            except Exception as exc:
                failed.append((request_id, exc))
        self._send(failed)

    def _run(self) -> None:
        while not self._stopping:
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a scheduler bug: end every request, keep serving
                logger.exception("engine step failed")
                outputs = []
                for request_id in list(self._streams):
                    self.engine.abort(request_id)
                    self._send([(request_id, RuntimeError(f"engine step failed: {exc}"))])
            self._send([(out.request_id, out) for out in outputs])
            if self.on_step is not None:
                try:
                    self.on_step(self.engine, outputs)
                except Exception:
                    logger.exception("on_step callback failed")
