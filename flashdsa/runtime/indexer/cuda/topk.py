"""Indexer top-k through the native kernels of ``topk.cu``: one CTA per row, radix select on the
scores' bits, selection sorted in shared memory; or, for decode-sized batches of short rows, each
score's rank counted against its whole row by many CTAs. The fused score + top-k of a prefill
scores whole rows with the Triton ragged kernel, a bounded group of rows at a time, and selects
them here: one pass over each row instead of the Triton backend's merge after every key chunk.
Importing this module builds the indexer's native extension once (``flashdsa.runtime.native``); a
failed build raises ImportError, so dispatch falls back to Triton and says why."""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import native
from flashdsa.runtime.indexer.triton.logits import ragged_logits_into
from flashdsa.runtime.indexer.triton.topk import SCRATCH_BYTES

native.load("indexer")
_indexer_topk_cuda = torch.ops.flashdsa.indexer_topk_cuda.default  # the overload, resolved once


def indexer_topk(logits: torch.Tensor, topk: int, starts: Optional[torch.Tensor], ends: Optional[torch.Tensor],
                 sorted: bool = True) -> torch.Tensor:
    """logits: [T, L] fp32, starts/ends: [T] int32 (both None: whole rows) -> [T, topk] int32: the
    columns of the topk largest finite scores in [start, end), by descending score with ties to the lower column
    (``sorted``) or by ascending column (the rank kernel's batches: as sorted), then -1. CUDA-graph
    capturable (no host sync)."""
    out = torch.empty(logits.shape[0], topk, dtype=torch.int32, device=logits.device)
    _topk_into(out, logits if logits.stride(-1) == 1 else logits.contiguous(), starts, ends, topk, sorted)
    return out


def _topk_into(out: torch.Tensor, logits: torch.Tensor, starts: Optional[torch.Tensor],
               ends: Optional[torch.Tensor], topk: int, sorted: bool) -> None:
    """The kernel's selection of ``logits`` (unit column stride) written into ``out: [T, topk]``, on
    the current stream of logits' device (a graph's while one is captured). Its raw handle comes from
    one call, as Triton's launcher gets it: ``torch.cuda.current_stream(device)`` builds a Stream in Python."""
    if logits.shape[0] == 0:
        return
    stream = torch._C._cuda_getCurrentRawStream(logits.get_device())
    _indexer_topk_cuda(logits, starts, ends, topk, sorted, out, stream)


def indexer_fused_topk(q_fp8, weights, k_fp8, k_scale, starts, ends, topk: int, chunk: int) -> torch.Tensor:
    """Top-k of the indexer logits (arguments of ``indexer_logits``; ``chunk``, the Triton backend's
    merge step, is not needed): the ragged kernel writes whole rows of a group of queries into a
    buffer of at most SCRATCH_BYTES (at least one row), the native kernel selects each row's
    [start, end), sorted as ``indexer_topk``. Positions equal top-k of ``indexer_logits``."""
    num_q, num_keys = q_fp8.shape[0], k_fp8.shape[0]
    out = torch.empty(num_q, topk, dtype=torch.int32, device=q_fp8.device)
    q_fp8, weights, k_fp8, k_scale = (t.contiguous() for t in (q_fp8, weights, k_fp8, k_scale))
    group = max(1, min(num_q, SCRATCH_BYTES // (4 * max(1, num_keys))))
    scores = torch.empty(group, num_keys, dtype=torch.float32, device=q_fp8.device)
    for r0 in range(0, num_q, group):
        rows = slice(r0, min(r0 + group, num_q))
        n = rows.stop - r0
        ragged_logits_into(scores[:n], q_fp8[rows], weights[rows], k_fp8, k_scale, starts[rows], ends[rows])
        _topk_into(out[rows], scores[:n], starts[rows], ends[rows], topk, True)
    return out
