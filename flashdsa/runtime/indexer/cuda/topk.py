"""Indexer top-k through the native kernels: ``topk_cluster.cu`` (a cluster of CTAs holds a row in
shared memory, read once) for rows up to ~160K columns, ``topk.cu`` (one CTA streams a row per
pass) for longer ones; both a radix select on the scores' bits, the selection sorted in shared
memory. Importing this module builds the indexer's native extension once
(``flashdsa.runtime.native``); a failed build raises ImportError, so dispatch falls back to Triton
and says why."""

from __future__ import annotations

import torch

from flashdsa.runtime import native

native.load("indexer")


def indexer_topk(logits: torch.Tensor, topk: int, starts: torch.Tensor, ends: torch.Tensor,
                 sorted: bool = True, one_cta_per_row: bool = False) -> torch.Tensor:
    """logits: [T, L] fp32, starts/ends: [T] int32 -> [T, topk] int32: the columns of the topk
    largest finite scores in [start, end), by descending score with ties to the lower column
    (``sorted``) or by ascending column, then -1. CUDA-graph capturable (no host sync).
    ``one_cta_per_row`` forces the streaming kernel on every row (benchmarks and tests compare)."""
    out = torch.empty(logits.shape[0], topk, dtype=torch.int32, device=logits.device)
    if logits.shape[0] == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    torch.ops.flashdsa.indexer_topk_cuda(logits, starts, ends, topk, sorted, one_cta_per_row, out, stream)
    return out
