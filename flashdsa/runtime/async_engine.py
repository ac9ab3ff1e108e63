"""The engine behind an asyncio server: the step loop runs in its own thread.

Requests and aborts reach the loop through a thread-safe command queue; outputs come back to
the event loop (call_soon_threadsafe) on one asyncio.Queue per group of requests (the choices of
one API call). Admission is synchronous on the event loop, so the cap on sequences in flight is
exact; a request leaves the count when it finishes, fails or is aborted, whether or not anyone
reads its outputs. Nothing a request does can stop the loop: failures end that request with an
error output.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable, Optional

from flashdsa.runtime.engine import LLMEngine
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.sequence import RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


class Unavailable(RuntimeError):
    """The server cannot take the request now (all places taken, or the engine stopped): a 503."""


def error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(request_id, [], "", True, 0, 0, finish_reason="error", error=message)


class RequestGroup:
    """The outputs of several engine requests (the choices of one API call) as (index, output),
    in the order they come. close() aborts the requests that have not finished."""

    def __init__(self, llm: "AsyncLLM", request_ids: list[str]) -> None:
        self.llm = llm
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.index = {request_id: i for i, request_id in enumerate(request_ids)}

    def __aiter__(self) -> "RequestGroup":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.unfinished and self.queue.empty():
            raise StopAsyncIteration
        out: RequestOutput = await self.queue.get()
        return self.index[out.request_id], out

    def deliver(self, out: RequestOutput) -> None:
        if out.finished:
            self.unfinished.discard(out.request_id)
        self.queue.put_nowait(out)

    def close(self) -> None:
        for request_id in list(self.unfinished):
            self.llm.abort(request_id)
        self.unfinished.clear()


class AsyncLLM:
    """Wraps an LLMEngine; ``on_step(engine, outputs)`` runs on the engine thread after each step.

    At most max_num_seqs + max_queued sequences are in flight; more get Unavailable (503).
    """

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
        self._groups: dict[str, RequestGroup] = {}  # request id -> its group, while unfinished
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread = threading.Thread(target=self._run, name="flashdsa-engine", daemon=True)

    @property
    def num_active(self) -> int:
        """Sequences admitted and not finished."""
        return len(self._groups)

    @property
    def capacity(self) -> int:
        return self.engine.config.max_num_seqs + self.max_queued

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._deliver([error_output(request_id, "the server is shutting down") for request_id in self._groups])

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def check(self, prompt_token_ids: list[int], params: SamplingParams, count: int = 1) -> None:
        """ValueError if the request is invalid here or could never fit (count sequences). No side effects."""
        self.engine.check_request(prompt_token_ids, params)
        if count > self.capacity:
            raise ValueError(f"the request asks for {count} sequences (prompts x n); this server takes at most "
                             f"{self.capacity} (max_num_seqs + max_queued)")

    def add(self, requests: list[tuple[str, list[int], SamplingParams]]) -> RequestGroup:
        """Admit requests (id, prompt token ids, params; each passed check()) all together or none:
        Unavailable if they do not fit in the free places. Call from the event loop."""
        if not self.is_alive():
            raise Unavailable("the engine is not running (the server is shutting down or its engine thread died)")
        free = self.capacity - self.num_active
        if len(requests) > free:
            raise Unavailable(
                f"the server is busy: {self.num_active} of its {self.capacity} sequence places (max_num_seqs "
                f"{self.engine.config.max_num_seqs} + max_queued {self.max_queued}) are taken and this request "
                f"needs {len(requests)}; retry later"
            )
        ids = [request_id for request_id, _, _ in requests]
        if len(set(ids)) != len(ids) or any(request_id in self._groups for request_id in ids):
            raise ValueError("request ids must be unique")
        group = RequestGroup(self, ids)
        for request in requests:
            self._groups[request[0]] = group
            self._post(("add", *request))
        return group

    def abort(self, request_id: str) -> None:
        if self._groups.pop(request_id, None) is not None:
            self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: hand outputs to their groups; finished requests leave the count."""
        for out in outputs:
            group = self._groups.pop(out.request_id, None) if out.finished else self._groups.get(out.request_id)
            if group is not None:
                group.deliver(out)

    def _send(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, outputs)

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
                logger.exception("request %s could not be added", request_id)
                self.engine.num_failed += 1
                failed.append(error_output(request_id, str(exc)))
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
            except Exception as exc:  # a bug outside any one request: end every request, keep serving
                logger.exception("engine step failed")
                outputs = self.engine.fail_all(f"engine step failed: {exc}")
            self._send(outputs)
            if self.on_step is not None:
                try:
                    self.on_step(self.engine, outputs)
                except Exception:
                    logger.exception("on_step callback failed")
