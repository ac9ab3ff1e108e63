"""DeepSeek-V4's KV compressors and the lightning indexer of compressed sparse attention (CSA).

A compressor turns every ``ratio`` consecutive tokens into one compressed K=V entry: per token
``c = x W_kv`` and gate ``z = x W_gate + ape[slot]``; an entry is the softmax(z)-weighted sum of its
window's ``c`` (per channel, fp32 softmax), RMS-normalized, its trailing RoPE dims rotated at the
window's first position. HCA (ratio 128) uses plain windows. CSA (ratio 4) overlaps them: the
projections are ``2d`` wide, the first ``d`` channels (Ca) of window ``w - 1`` and the last ``d``
(Cb) of window ``w`` form entry ``w`` (2 * ratio slots); window 0's Ca slots weigh 0.

Entries are made only from whole windows: a query at position ``p`` may use entries
``j < (p + 1) // ratio``. Tokens of an unfinished window wait in :class:`CompressorState`
(with the last window's Ca half for the overlap), so a prefill followed by decode steps produces
exactly the entries of one full-sequence pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashdsa.models.hyper_connections import RMSNorm
from flashdsa.models.rope import RopeAt


@dataclass
class CompressorState:
    """One sequence's compressor state: tokens of the unfinished window (``pending_*: [p, W]``,
    p < ratio), the last window's Ca half with its gates (``prior_*: [ratio, d]``, overlap only),
    and every entry made so far (``entries: [N, d]``)."""

    pending_kv: torch.Tensor | None = None
    pending_gate: torch.Tensor | None = None
    prior_kv: torch.Tensor | None = None
    prior_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return 0 if self.entries is None else self.entries.shape[0]


class Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens into one ``head_dim`` entry (overlapping windows when ``overlap``)."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = head_dim * (2 if overlap else 1)
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, state: CompressorState, rope) -> torch.Tensor:
        """Feed tokens ``x: [S, hidden]`` (the next ones of the sequence) and return every entry so
        far, ``[N, head_dim]``. ``rope(positions)`` is the RoPE (a ``RopeAt``) of window starts."""
        m, d = self.ratio, self.head_dim
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if state.pending_kv is not None:
            kv, gate = torch.cat([state.pending_kv, kv]), torch.cat([state.pending_gate, gate])
        usable = kv.shape[0] // m * m
        state.pending_kv, state.pending_gate = kv[usable:], gate[usable:]
        windows = usable // m
        if windows == 0:
            return state.entries if state.entries is not None else kv.new_zeros(0, d)
        kv = kv[:usable].view(windows, m, -1)
        gate = gate[:usable].view(windows, m, -1) + self.position_bias
        if self.overlap:
            kv, gate = self._overlap(kv, gate, state)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        pooled = self.kv_norm((kv * weights).sum(dim=1))  # [windows, d]
        starts = torch.arange(windows, device=x.device) * m + state.count * m
        entries = rope(starts).rotate_tail(pooled)
        state.entries = entries if state.entries is None else torch.cat([state.entries, entries])
        return state.entries

    def _overlap(self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState):
        """``[w, m, 2d]`` -> ``[w, 2m, d]``: window w-1's Ca slots, then window w's Cb slots."""
        windows, m, d = kv.shape[0], self.ratio, self.head_dim
        prior_kv = kv.new_zeros(1, m, d) if state.prior_kv is None else state.prior_kv[None]
        prior_gate = gate.new_full((1, m, d), float("-inf")) if state.prior_gate is None else state.prior_gate[None]
        state.prior_kv, state.prior_gate = kv[-1, :, :d].clone(), gate[-1, :, :d].clone()
        ca_kv = torch.cat([prior_kv.to(kv.dtype), kv[:-1, :, :d]])
        ca_gate = torch.cat([prior_gate.to(gate.dtype), gate[:-1, :, :d]])
        return torch.cat([ca_kv, kv[..., d:]], dim=1), torch.cat([ca_gate, gate[..., d:]], dim=1)


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[S]`` positions -> ``[S]`` number of whole windows each query may see: ``(p + 1) // ratio``."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


class EntryChoice(nn.Module):
    """The identity on the chosen entry ids ``[S, k]``: a module so that a forward hook (the
    layerwise check) sees each CSA layer's choice, whichever path made it."""

    def forward(self, picked: torch.Tensor) -> torch.Tensor:
        return picked


class Indexer(Compressor):
    """Lightning indexer: an overlapping compressor of its own at ``index_head_dim`` gives keys ``K``;
    the score of entry s for query t is ``sum_h w[t,h] * relu(q[t,h] . K[s]) / sqrt(index_head_dim)``,
    ``w = weights_proj(x) / sqrt(index_n_heads)``, ``q = q_b_proj(q_residual)`` RoPE'd at t."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, ratio: int, eps: float):
        super().__init__(hidden, head_dim, ratio, overlap=True, eps=eps)
        self.heads, self.topk = heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(hidden, heads, bias=False)
        self.choice = EntryChoice()

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, state: CompressorState,
               rope) -> torch.Tensor:
        """Top-k compressed entries for each query: ``[S, min(index_topk, N)]`` int64, -1 where fewer
        than k entries are visible. ``x: [S, hidden]``, ``q_residual: [S, q_lora_rank]``."""
        keys = self(x, state, rope)  # [N, head_dim]
        q, weights = self.queries(x, q_residual, rope(positions))
        return self.choice(select_topk(self.score(q, keys, weights), visible_entries(positions, self.ratio), self.topk))

    def queries(self, x: torch.Tensor, q_residual: torch.Tensor, rope_at: RopeAt):
        """``(q [S, heads, head_dim] RoPE'd, weights [S, heads] fp32)`` of the queries ``x: [S, hidden]``,
        ``q_residual: [S, q_lora_rank]`` with their RoPE ``rope_at``."""
        q = rope_at.rotate_tail(self.q_b_proj(q_residual).view(x.shape[0], self.heads, self.head_dim))
        return q, self.scorer.weights_proj(x).float() * self.heads**-0.5

    def score(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """fp32 scores ``[S, N]`` of queries ``q: [S, heads, head_dim]`` (RoPE'd) against ``keys: [N,
        head_dim]`` (or per query, ``[S, N, head_dim]``: training scores each query's selected
        entries) with head weights ``weights: [S, heads]`` fp32 (``heads^-0.5`` folded in)."""
        scores = F.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2))) * self.head_dim**-0.5
        return torch.einsum("shn,sh->sn", scores, weights)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """``scores: [S, N]``, ``visible: [S]`` -> ``[S, min(topk, N)]`` int64 indices of the best visible
    entries, -1 for the slots left over when a query sees fewer than that many. Equal scores (the
    relu makes exact zeros common) go to the lower index, so a decode step picks what a full pass does."""
    k = min(topk, scores.shape[1])
    entry = torch.arange(scores.shape[1], device=scores.device)
    scores = scores.masked_fill(entry[None, :] >= visible[:, None], float("-inf"))
    picked = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(picked >= visible[:, None], -1, picked)
