"""Parallel branches in a captured decode step: independent work on a side stream.

At decode sizes most kernels of a step are latency-bound (a few CTAs, or a GEMV waiting on its
first DRAM loads), so two independent chains of them run together in about the time of the longer
one. Inside a CUDA graph capture, work issued on a side stream after :func:`branch` forks becomes a
parallel branch of the graph, and :meth:`Branch.join` makes the main stream wait for it, as SGLang
overlaps DeepSeek's shared expert with the routed ones. Outside a capture (eager steps, prefill,
reference mode) :func:`branch` returns a branch that runs on the current stream, so eager and graph
steps launch the same kernels on the same inputs and give the same bits.

Rules for a branch's body: it reads only tensors the main stream made before the fork and that stay
referenced until the join, and the main stream reads what the body made only after the join (both
hold for the callers: their locals live until the join).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

_side: dict[torch.device, torch.cuda.Stream] = {}  # device -> its side stream (made on first use)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so either spelling finds the device's stream."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    device = _indexed(device)
    if device not in _side:
        _side[device] = torch.cuda.Stream(device)
    return _side[device]


def on_side_stream(device: torch.device) -> bool:
    """Whether work issued now on ``device`` goes to its side stream (so may run beside the main
    stream's: a kernel with a per-device workspace must not use it there)."""
    if device.type != "cuda":
        return False
    side = _side.get(_indexed(device))
    return side is not None and torch.cuda.current_stream(device) == side


class Branch:
    """Work forked from the main stream (``side`` None: no fork, the work runs in line)."""

    def __init__(self, side: Optional[torch.cuda.Stream]):
        self.side, self.forked = side, False

    @contextmanager
    def run(self) -> Iterator[None]:
        """The body's kernels go to the side stream, which first waits for everything issued so far."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        self.forked = True
        with torch.cuda.stream(self.side):
            yield

    def join(self) -> None:
        """The main stream waits for the branch's work (no-op where nothing was forked)."""
        if self.forked:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.forked = False


def branch(x: torch.Tensor) -> Branch:
    """A side-stream branch while ``x``'s device is capturing a CUDA graph, else an in-line one."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    return Branch(_side_stream(x.device) if capturing else None)
