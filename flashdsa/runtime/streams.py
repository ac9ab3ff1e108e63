"""Parallel branches in a captured decode step: independent work on a side stream.

At decode sizes most kernels of a step are latency-bound (a few CTAs, or a GEMV waiting on its
first DRAM loads), so two independent chains of them run together in about the time of the longer
one. Inside a CUDA graph capture, work issued on a side stream after :func:`branch` forks becomes a
parallel branch of the graph, and :meth:`Branch.join` makes the current stream wait for it, as SGLang
overlaps DeepSeek's shared expert with the routed ones. Outside a capture (eager steps, prefill,
reference mode) :func:`branch` returns a branch that runs on the current stream, so eager and graph
steps launch the same kernels on the same inputs and give the same bits.

Rules for a branch's body: it reads only tensors made before the fork (or by a branch it joined
first) that stay referenced until the join, and what it makes is read only after its join (both
hold for the callers: their locals live until the join). Lazily computed shared results (a fused
GEMM's outputs) must be computed before the fork.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

LANES = 3  # side streams a device: a step forks at most this many branches at once
_side: dict[tuple[torch.device, int], torch.cuda.Stream] = {}  # (device, lane) -> stream, made on first use


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so either spelling finds the device's stream."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _side_stream(device: torch.device, lane: int) -> torch.cuda.Stream:
    key = (_indexed(device), lane)
    if key not in _side:
        _side[key] = torch.cuda.Stream(key[0])
    return _side[key]


def on_side_stream(device: torch.device) -> bool:
    """Whether work issued now on ``device`` goes to a side stream (so may run beside the main
    stream's: a kernel with a per-device workspace must not use it there)."""
    if device.type != "cuda":
        return False
    current = torch.cuda.current_stream(device)
    return any(current == _side.get((_indexed(device), lane)) for lane in range(LANES))


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
        """The current stream (the main one, or another branch's inside its ``run``) waits for the
        branch's work; no-op where nothing was forked or it was joined already."""
        if self.forked:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.forked = False


def branch(x: torch.Tensor, lane: int = 0) -> Branch:
    """A branch on side stream ``lane`` (0 .. LANES - 1: branches alive at once take different
    lanes) while ``x``'s device is capturing a CUDA graph, else an in-line one."""
    if not 0 <= lane < LANES:
        raise ValueError(f"lane must be in [0, {LANES}), got {lane!r}")
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    return Branch(_side_stream(x.device, lane) if capturing else None)
