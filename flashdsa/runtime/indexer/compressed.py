"""DeepSeek-V4's lightning indexer over CSA compressed keys: causality in compressed units + top-k.

V4 scores a query against compressed indexer keys (one per ``ratio`` = 4 tokens) with V3.2's
equation, ``score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``, where transformers'
``DeepseekV4IndexerScorer`` scales by ``index_head_dim^-0.5`` after the ReLU and the weights by
``index_n_heads^-0.5``: both are positive, so they fold into ``w`` exactly
(``weights = weights_proj(x) * index_n_heads^-0.5 * index_head_dim^-0.5``). Entry s is visible to
the query at position p when its window has closed, ``s < (p + 1) // ratio``; the top ``index_topk``
(512 in V4-Flash) visible entries are kept, -1 padded.

Two ways through, sharing :func:`compressed_ranges`:
- reference precision (as transformers: unquantized q and keys, fp32 scores):
  :func:`compressed_indexer_topk`;
- production (FP8 q and keys with power-of-two scales, as the V3.2 indexer cache holds them):
  ``indexer_fused_topk(q_fp8, weights * q_scale, k_fp8, k_scale, *compressed_ranges(...), topk)``,
  the existing Triton fused score + top-k, with these ranges.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime.checks import check, check_tensor
from flashdsa.runtime.indexer import indexer_topk
from flashdsa.runtime.indexer import reference as indexer_reference

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def compressed_ranges(positions: torch.Tensor, ratio: int, num_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Visible compressed entries ``[starts, ends)`` per query: ``starts = 0``, ``ends =
    min((positions + 1) // ratio, num_entries)``; ``positions: [T]`` int32/int64 -> int32 ``[T]`` each.
    No host sync."""
    check_tensor("positions", positions, (torch.int32, torch.int64), [None], "int32/int64 [T]")
    check(isinstance(ratio, int) and ratio >= 1, f"ratio must be an int >= 1, got {ratio!r}")
    check(isinstance(num_entries, int) and num_entries >= 0, f"num_entries must be an int >= 0, got {num_entries!r}")
    ends = ((positions.long() + 1) // ratio).clamp(0, num_entries).to(torch.int32)
    return torch.zeros_like(ends), ends


def compressed_indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int,
    *, backend: Optional[str] = None,
) -> torch.Tensor:
    """Top-k visible compressed entries per query, at transformers' precision.

    q: ``[T, H, D]`` float, the RoPE'd indexer queries. weights: ``[T, H]`` fp32, per-head weights
    with the constants folded in (module docstring). keys: ``[N, D]`` float, the compressed indexer
    keys (after their norm and RoPE). positions: ``[T]`` int the queries' positions. ratio: the CSA
    compression (4). topk: int >= 1. backend: for the top-k ("reference" or "triton").
    Returns ``[T, topk]`` int32 entry ids by descending score (ties to the lower id), -1 padded.
    """
    check_tensor("q", q, FLOATS, [None, None, None], "bf16/fp16/fp32 [T, H, D]")
    num_q, heads, dim = q.shape
    check_tensor("weights", weights, torch.float32, [num_q, heads], f"fp32 [T={num_q}, H={heads}]", q.device)
    check_tensor("keys", keys, FLOATS, [None, dim], f"float [N, D={dim}]", q.device)
    check_tensor("positions", positions, (torch.int32, torch.int64), [num_q], f"int32/int64 [T={num_q}]", q.device)
    starts, ends = compressed_ranges(positions, ratio, keys.shape[0])
    ones = torch.ones(keys.shape[0], dtype=torch.float32, device=q.device)
    logits = indexer_reference.indexer_logits(q, weights, keys, ones, starts, ends)
    return indexer_topk(logits, topk, starts, ends, backend=backend)
