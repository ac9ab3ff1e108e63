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
    the copies (queued at construction, behind the work that produces the tensors) are done. The
    copies hold the values of that moment, also on the CPU (a tensor may be a static buffer that a
    later step rewrites: ``ModelRunner.verdict_buffer``)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if tensors and tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = [t.clone() for t in tensors]

    def wait(self) -> list[torch.Tensor]:
        """The tensors on the host; blocks until their copies finished (the only host sync)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


def gather_or_keep(source: torch.Tensor, index: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kept`` with element i replaced by ``source[index[i]]`` where ``index[i] >= 0`` (int64
    indices; same shape and device). Device ops only, no host sync: CUDA graphs capture it."""
    return torch.where(index >= 0, source[index.clamp(min=0)], kept)


def flags_at(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Bool ``[len(index)]``: ``source[index[i]]`` is nonzero, False where ``index[i] < 0``."""
    return gather_or_keep(source, index, torch.zeros_like(index)) != 0


class TokenFill:
    """What a step launched behind another (async scheduling) takes from the device, as host
    indices into ``source`` (device int64, what the step in flight left there: the tokens it
    sampled, or a speculative step's packed verdict, ``speculative.DeviceVerdict``), so step n+1's
    inputs never wait for step n's tokens to reach the host.

    ids: [T] host ints, flat token j's input id is ``source[ids[j]]`` where ``ids[j] >= 0`` (-1:
    the host's id stands). moves: [B] host ints, or None: sequence b runs one position on
    (``metadata.advance``) where ``moves[b] >= 0`` and ``source[moves[b]]`` is nonzero (the step in
    flight accepted its draft). A CUDA-graph step stages both in its input buffer and the graph
    reads ``source`` itself (``cuda_graphs.DecodeGraphs``); an eager step uses :meth:`apply`."""

    def __init__(self, source: torch.Tensor, ids: list[int], moves: Optional[list[int]] = None) -> None:
        self.source, self.ids, self.moves = source, ids, moves

    def apply(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``input_ids: [T]`` int64 (on the source's device) with the device's ids filled in, and
        which sequences move ``[B]`` bool (None without ``moves``); the indices go up in one
        non-blocking copy."""
        moves = self.moves or []
        index = to_device(torch.tensor(self.ids + moves, dtype=torch.int64), input_ids.device)
        ids, moves_index = index.split([len(self.ids), len(moves)])
        filled = gather_or_keep(self.source, ids, input_ids)
        return filled, None if self.moves is None else flags_at(self.source, moves_index)
