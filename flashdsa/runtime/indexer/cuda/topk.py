"""Indexer top-k through the native kernels of ``topk.cu``: one CTA per row, radix select on the
scores' bits, selection sorted in shared memory; or, for decode-sized batches of short rows, each
score's rank counted against its whole row by many CTAs. Importing this module builds the indexer's
native extension once (``flashdsa.runtime.native``); a failed build raises ImportError, so
dispatch falls back to Triton and says why."""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import native

native.load("indexer")


def indexer_topk(logits: torch.Tensor, topk: int, starts: Optional[torch.Tensor], ends: Optional[torch.Tensor],
                 sorted: bool = True) -> torch.Tensor:
    """logits: [T, L] fp32, starts/ends: [T] int32 (both None: whole rows) -> [T, topk] int32: the
    columns of the topk largest finite scores in [start, end), by descending score with ties to the lower column
    (``sorted``) or by ascending column (the rank kernel's batches: as sorted), then -1. CUDA-graph
    capturable (no host sync)."""
    out = torch.empty(logits.shape[0], topk, dtype=torch.int32, device=logits.device)
    if logits.shape[0] == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    torch.ops.flashdsa.indexer_topk_cuda(logits, starts, ends, topk, sorted, out, stream)
    return out
