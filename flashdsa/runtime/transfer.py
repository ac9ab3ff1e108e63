"""Host <-> device copies that never make the host wait for the GPU.

``tensor.to("cuda")`` from pageable memory, and ``torch.tensor(values, device="cuda")``, end with a
stream synchronisation: the host waits for every kernel queued before it. The engine's step
loop may not wait there (it queues step n+1 while step n runs), so host data goes up from pinned
memory with ``non_blocking=True`` and results come down the same way, into pinned buffers that
the host reads after a CUDA event says the copy is done. On the CPU both are plain copies.
"""

from __future__ import annotations

from typing import Optional

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (CPU) on ``device``, queued behind the stream's work without waiting for it."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def tensor_on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host sync on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), device)


class HostCopy:
    """Device tensors on their way to the host: :meth:`wait` returns them as CPU tensors once
    the copies (queued at construction, behind the work that produces the tensors) are done."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if tensors and tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = list(tensors)

    def wait(self) -> list[torch.Tensor]:
        """The tensors on the host; blocks until their copies finished (the only host sync)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


class TokenFill:
    """Input ids that only the device knows yet: ``ids[dst[j]] = tokens[src[j]]`` for host index
    lists ``dst`` and ``src`` and device ``tokens`` int64 (what the previous step sampled: its
    tokens, and after a speculative step also its drafts). The indices go up in one non-blocking
    copy; the gather and scatter run on the device, so step n+1's input never waits for step n's
    tokens to reach the host.

    After a speculative step, ``accepted: [R]`` bool (device) says whose draft it accepted and
    ``rows[b]`` is sequence b's row in it (-1: the step did not verify one for it): those
    sequences run one position later when accepted (``metadata.Outcomes``)."""

    def __init__(self, dst: list[int], src: list[int], tokens: torch.Tensor, rows: Optional[list[int]] = None,
                 accepted: Optional[torch.Tensor] = None) -> None:
        self.dst, self.src, self.tokens = dst, src, tokens
        self.rows, self.accepted = rows, accepted

    def apply(self, ids: torch.Tensor) -> None:
        """Write the tokens into ``ids: [T]`` int64 (on the tokens' device), in place."""
        index = to_device(torch.tensor([self.dst, self.src], dtype=torch.int64), ids.device)
        ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]))
