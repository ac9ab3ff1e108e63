"""Reference (torch) lightning-indexer ops: the ground truth for the GPU kernels.

No validation here: the public functions in ``flashdsa.runtime.indexer`` check inputs first.

Scores are deterministic and independent of how keys are chunked: each FP8 dot product is
computed in float64, where it is exact (e4m3 products are multiples of 2^-18 below 2^18, and
128 of them sum to under 2^25, so 43 bits suffice), and the sum over heads runs in a fixed order
in float64 before one rounding to fp32. So a score never depends on which other keys share its
chunk, and the fused top-k equals top-k of the full logits bit for bit, ties included.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from flashdsa.runtime.cache.layout import indexer_block_views, quantize_indexer_key

# Elements of the largest float64 temporary (rows x keys) a reference op materialises at once.
CHUNK_ELEMENTS = 1 << 23


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Fast Walsh-Hadamard transform of ``x: [..., n]`` (n a power of two) times ``n^-0.5``.

    Sylvester order (``H[i, j] = (-1)^popcount(i & j)``), log2(n) butterfly stages in fp32
    (float64 for float64 input); returns ``x``'s dtype.
    """
    n = x.shape[-1]
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    lead = y.shape[:-1]
    h = 1
    while h < n:
        pairs = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return (y * n**-0.5).to(x.dtype)


def rotate_quantize_indexer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [..., 128]`` Hadamard-rotated (in x's dtype), then e4m3 with one power-of-two scale per
    row: (e4m3 [..., 128], scale fp32 [...])."""
    return quantize_indexer_key(hadamard_transform(x))


def _row_chunk(num_keys: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, num_keys))


def indexer_logits(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
) -> torch.Tensor:
    """``score[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q_fp8[t, h] . k_fp8[s])`` for
    ``starts[t] <= s < ends[t]``, ``-inf`` elsewhere; ``[T, S]`` fp32, computed in row chunks."""
    num_q, num_heads, _ = q_fp8.shape
    num_keys = k_fp8.shape[0]
    out = torch.empty(num_q, num_keys, dtype=torch.float32, device=q_fp8.device)
    k = k_fp8.double()
    k_scale = k_scale.double()
    cols = torch.arange(num_keys, device=q_fp8.device)
    step = _row_chunk(num_keys)
    for t0 in range(0, num_q, step):
        q = q_fp8[t0 : t0 + step].double()
        w = weights[t0 : t0 + step].double()
        acc = torch.zeros(q.shape[0], num_keys, dtype=torch.float64, device=q.device)
        for h in range(num_heads):  # fixed order: the sum over heads is chunking-independent
            acc += w[:, h, None] * torch.relu(q[:, h] @ k.T)
        inside = (cols >= starts[t0 : t0 + step, None]) & (cols < ends[t0 : t0 + step, None])
        out[t0 : t0 + step] = torch.where(inside, acc * k_scale, -math.inf).float()
    return out


def gather_indexer_keys(
    k_cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of positions ``[0, length)`` of one sequence: (e4m3 ``[length, 128]``, fp32 ``[length]``)."""
    keys, scales = indexer_block_views(k_cache)
    block_size = keys.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return keys[blocks].flatten(0, 1)[:length], scales[blocks].flatten()[:length]


def indexer_logits_paged(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_context_len: int,
    fill_past_context: bool = True,
) -> torch.Tensor:
    """Decode logits ``[B * n, max_context_len]`` fp32: query j of request b sits at position
    ``context_lens[b] - n + j`` and scores positions ``[0, that position]``; -inf beyond (also
    past the context: ``fill_past_context`` only lets the GPU kernels skip those)."""
    batch, n = q_fp8.shape[:2]
    out = torch.full((batch * n, max_context_len), -math.inf, dtype=torch.float32, device=q_fp8.device)
    for b in range(batch):
        length = int(context_lens[b])
        keys, scales = gather_indexer_keys(k_cache, block_tables[b], length)
        ends = torch.arange(length - n + 1, length + 1, device=q_fp8.device)
        rows = slice(b * n, (b + 1) * n)
        out[rows, :length] = indexer_logits(q_fp8[b], weights[rows], keys, scales, torch.zeros_like(ends), ends)
    return out


def _select(values: torch.Tensor, positions: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best ``topk`` of each row by (value desc, position asc); ``positions`` must ascend along
    each row among equal values (a stable sort then keeps the lower position first)."""
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return values[:, :topk], positions.gather(-1, order[:, :topk])


def _finish(values: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Mark entries without a finite score -1 and pad to ``topk`` columns with -1."""
    positions = torch.where(torch.isfinite(values), positions, -1).int()
    pad = topk - positions.shape[1]
    return torch.nn.functional.pad(positions, (0, pad), value=-1) if pad > 0 else positions


def _in_range_scores(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``logits`` with entries outside ``[starts, ends)`` or non-finite set to -inf."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    keep = (cols >= starts[:, None]) & (cols < ends[:, None]) & torch.isfinite(logits)
    return torch.where(keep, logits, -math.inf)


def indexer_topk(logits: torch.Tensor, topk: int, starts: Optional[torch.Tensor], ends: Optional[torch.Tensor],
                 sorted: bool = True) -> torch.Tensor:
    """Positions ``[T, topk]`` int32 of the ``topk`` largest finite scores in ``[starts, ends)``
    (both None: whole rows), by descending score, ties to the lower position, -1 padded (always
    sorted: any order is allowed with ``sorted=False``)."""
    if starts is None:
        starts = torch.zeros(logits.shape[0], dtype=torch.int32, device=logits.device)
        ends = torch.full_like(starts, logits.shape[1])
    out = []
    step = max(1, CHUNK_ELEMENTS // max(1, logits.shape[1]))
    for t0 in range(0, logits.shape[0], step):
        scores = _in_range_scores(logits[t0 : t0 + step], starts[t0 : t0 + step], ends[t0 : t0 + step])
        cols = torch.arange(scores.shape[1], device=scores.device).expand_as(scores)
        out.append(_finish(*_select(scores, cols, topk), topk))
    if not out:
        return torch.empty(0, topk, dtype=torch.int32, device=logits.device)
    return torch.cat(out)


def indexer_fused_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    chunk: int,
) -> torch.Tensor:
    """``indexer_topk(indexer_logits(...), topk, starts, ends)`` without a whole logits row:
    walks the keys ``chunk`` at a time and merges each chunk into a running top-k list."""
    num_q, device = q_fp8.shape[0], q_fp8.device
    best = torch.full((num_q, 0), -math.inf, dtype=torch.float32, device=device)
    best_pos = torch.empty(num_q, 0, dtype=torch.int64, device=device)
    for s0 in range(0, k_fp8.shape[0], chunk):
        s1 = min(s0 + chunk, k_fp8.shape[0])
        part = indexer_logits(q_fp8, weights, k_fp8[s0:s1], k_scale[s0:s1], starts - s0, ends - s0)
        part = torch.where(torch.isfinite(part), part, -math.inf)  # outside the range: -inf already
        cols = torch.arange(s0, s1, device=device).expand(num_q, -1)
        # running entries come first: all their positions are lower than this chunk's
        best, best_pos = _select(torch.cat((best, part), 1), torch.cat((best_pos, cols), 1), topk)
    return _finish(best, best_pos, topk)
