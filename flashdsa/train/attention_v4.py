"""DeepSeek-V4 attention for training: B whole sequences at once, under autograd, plain torch.

It runs the inference block's own modules (``DeepseekV4Attention.project`` / ``output``, its
``Compressor`` and ``Indexer``) over the batch flattened to T = B * L tokens. Every query attends,
with the block's sinks, to rows of one pool ``[T raw K=V rows ; B * N compressed entries]``:

    window   the raw rows of positions (p - sliding_window, p] of its own sequence (every layer)
    HCA      every visible entry of its sequence (j < (p + 1) // ratio)
    CSA      dense: every visible entry, as HCA; sparse: the indexer's top-k visible entries
             (indices detached), exactly as the inference model selects them

The indexer scores from detached inputs (``x``, ``q_residual``), so its KL loss reaches the indexer
alone: KL(p_t || softmax(I_t)) with p_t the attention weight of each compressed entry (the window
and the sink left out) summed over heads and L1-normalised, over every visible entry (dense) or
the selected ones (sparse); queries that see no entry yet are left out of the mean. The attention
core is ``sparse_sink_attention`` checkpointed per ``QUERY_CHUNK`` queries, so the backward never
holds more than one chunk's gathered rows. The sparse stage selects from ``SELECT_CHUNK`` score
rows at a time and differentiates only the selected entries' scores; the dense warm-up
differentiates every visible entry's (``[L, H_I, L / ratio]`` per sequence). There is no fused
(Triton) V4 backward: this is the reference computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from flashdsa.models.deepseek_v4_attention import (QUERY_CHUNK, DeepseekV4Attention, RopeTable, sink_probabilities,
                                                   sparse_sink_attention)
from flashdsa.models.deepseek_v4_compressor import CompressorState, select_topk, visible_entries
from flashdsa.models.deepseek_v4_config import CSA
from flashdsa.models.rope import RopeAt
from flashdsa.train.indexer import SELECT_CHUNK
from flashdsa.train.losses import indexer_kl


@dataclass
class V4Step:
    """What every attention block of one training forward needs: batch B, length L, each token's
    position and sequence ``[T]``, each rope's table and its RoPE at the positions, the mode."""

    batch: int
    length: int
    positions: torch.Tensor
    sequence: torch.Tensor
    ropes: dict[str, RopeTable]
    angles: dict[str, RopeAt]
    attention: str  # "dense" or "sparse" (CSA layers only)
    indexer_loss: bool


def v4_attention(attn: DeepseekV4Attention, x: torch.Tensor, step: V4Step) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One attention block over ``x: [T, hidden]`` -> ``([T, hidden], indexer KL scalar or None)``
    (None unless a CSA block with ``step.indexer_loss``)."""
    rope_at = step.angles["compress" if attn.ratio else "main"]
    q_residual, q, kv = attn.project(x, rope_at)
    indices, pool, kl = _window(attn.window, step), kv, None
    if attn.ratio:
        B, L = step.batch, step.length
        entries = torch.cat([attn.compressor(seq, CompressorState(), step.ropes["compress"]) for seq in x.view(B, L, -1)])
        visible = visible_entries(step.positions, attn.ratio)  # [T]
        count = entries.shape[0] // B  # entries per sequence
        entry = torch.arange(count, device=x.device)
        picked = torch.where(entry[None, :] < visible[:, None], entry, -1)  # [T, N]: every visible entry
        scores = None
        if attn.layer_type == CSA and (step.attention == "sparse" or step.indexer_loss):
            scores, picked = _index(attn, x.detach(), q_residual.detach(), visible, picked, step)
        first = kv.shape[0] + step.sequence[:, None] * count
        indices = torch.cat([indices, torch.where(picked >= 0, picked + first, -1)], dim=1)
        pool = torch.cat([kv, entries])
        if scores is not None and step.indexer_loss:
            kl = _indexer_kl(attn, q, pool, indices, picked, scores)
    return attn.output(_attend(q, pool, indices, attn.sinks, attn.head_dim**-0.5), rope_at), kl


def _window(window: int, step: V4Step) -> torch.Tensor:
    """``[T, window]`` pool rows of each query's sliding window (its own sequence), -1 before its start."""
    start = step.sequence * step.length
    offsets = torch.arange(window, device=step.positions.device) - (window - 1)
    window_pos = step.positions[:, None] + offsets
    return torch.where(window_pos >= 0, window_pos + start[:, None], -1)


def _index(attn: DeepseekV4Attention, x: torch.Tensor, q_residual: torch.Tensor, visible: torch.Tensor,
           picked: torch.Tensor, step: V4Step) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer over detached inputs: (differentiable scores of the candidate entries ``[T, K]``,
    the candidates ``[T, K]``: every visible entry (dense) or the top-k (sparse), -1 invalid)."""
    indexer, B, L = attn.compressor.indexer, step.batch, step.length
    keys = [indexer(seq, CompressorState(), step.ropes["compress"]) for seq in x.view(B, L, -1)]  # B x [N, D_I]
    q, w = indexer.queries(x, q_residual, step.angles["compress"])  # [T, H_I, D_I], [T, H_I]
    per_sequence = list(zip(q.view(B, L, *q.shape[1:]), keys, w.view(B, L, -1), visible.view(B, L)))
    if step.attention == "dense":  # [T, N], differentiable
        return torch.cat([indexer.score(qb, kb, wb) for qb, kb, wb, _ in per_sequence]), picked
    with torch.no_grad():  # SELECT_CHUNK score rows at a time
        picked = torch.cat([select_topk(indexer.score(qb[rows], kb, wb[rows]), vb[rows], indexer.topk)
                            for qb, kb, wb, vb in per_sequence for rows in _chunks(L, SELECT_CHUNK)])  # [T, k]
    count = keys[0].shape[0]
    rows = picked.clamp_min(0) + step.sequence[:, None] * count
    chosen = torch.cat(keys).index_select(0, rows.flatten()).view(*rows.shape, -1)  # [T, k, D_I]
    return indexer.score(q, chosen, w), picked


def _indexer_kl(attn: DeepseekV4Attention, q: torch.Tensor, pool: torch.Tensor, indices: torch.Tensor,
                picked: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """KL from the attention's (detached) weights of the candidate entries, summed over heads, to
    the indexer's softmax over them; queries with no candidate are left out."""
    window = indices.shape[1] - picked.shape[1]
    with torch.no_grad():
        ok = (indices >= 0) & (indices < pool.shape[0])
        target = torch.cat([sink_probabilities(q[rows], pool[torch.where(ok[rows], indices[rows], 0)].float(), ok[rows],
                                               attn.sinks, attn.head_dim**-0.5)[..., window:].sum(1)
                            for rows in _chunks(q.shape[0])])
    valid = picked >= 0
    seen = valid.any(-1)
    if not bool(seen.any()):
        return scores.sum() * 0.0  # no query sees a compressed entry yet (a sequence shorter than a window)
    return indexer_kl(target[seen], scores[seen], valid[seen])


def _chunks(total: int, size: int = QUERY_CHUNK) -> list[slice]:
    return [slice(start, start + size) for start in range(0, total, size)]


def _attend(q: torch.Tensor, pool: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """``sparse_sink_attention``, recomputed per chunk of queries in the backward (bounded memory)."""
    if not torch.is_grad_enabled():
        return sparse_sink_attention(q, pool, indices, sinks, scale)
    return torch.cat([checkpoint(sparse_sink_attention, q[rows], pool, indices[rows], sinks, scale, use_reentrant=False)
                      for rows in _chunks(q.shape[0])])
