"""DeepSeek-V4 attention: one shared K=V head over a sliding window plus compressed entries.

Per token: ``q = rms(q_b(q_a_norm(q_a(x))))`` per head and ``kv = kv_norm(kv_proj(x))`` (one 512-wide
head used as key and value), the trailing ``qk_rope_head_dim`` dims of both RoPE'd. A query at
position p attends to the raw kv of positions ``(p - sliding_window, p]`` and, by layer type, to
nothing more (sliding), to every visible HCA entry, or to the CSA entries its lightning indexer
picks. Each head has a learned sink logit that joins the softmax's denominator only. The output's
RoPE dims are rotated back by the query's angle, then the heads go through the grouped output
projection (``o_groups`` groups, each projected to ``o_lora_rank``, then ``o_b_proj``).

The core is :func:`sparse_sink_attention`: queries, one pool of K=V rows and per-query indices into
it. Sliding-window rows and compressed entries are rows of the same pool, which is how the paged
V4 kernels (FlashMLA's MODEL1 sparse decode, one index list over the window and compressed caches)
see it, so the core can later route to them without changing the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from flashdsa.models.deepseek_v4_compressor import Compressor, CompressorState, Indexer, visible_entries
from flashdsa.models.deepseek_v4_config import CSA, HCA, DeepseekV4Config
from flashdsa.models.hyper_connections import RMSNorm, normalize_heads
from flashdsa.models.linear import FusedLinear, fuse_shared_input
from flashdsa.models.rope import RopeAt, Rotary

QUERY_CHUNK = 256  # queries per gather in the reference core (bounds its [chunk, K, D] working set)


def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor,
                          sm_scale: float, extra_kv: torch.Tensor | None = None,
                          extra_indices: torch.Tensor | None = None) -> torch.Tensor:
    """Sparse multi-query attention with per-head sinks, K = V.

    q: [S, H, D]; kv: [N, D] the K=V rows (window rows and compressed entries of one sequence);
    indices: [S, K] int64 rows of ``kv`` each query attends to, -1 (or any value outside [0, N))
    invalid and ignored, duplicates counted twice; sinks: [H] fp32; sm_scale: float;
    extra_kv, extra_indices: optionally a second pool ``[N2, D]`` and its ``[S, K2]`` rows, attended
    to together with the first (the engine keeps window rows and compressed entries apart).
    Returns out [S, H, D] in q's dtype: ``sum_k p_k kv[idx_k]`` with
    ``p_k = exp(s_k) / (exp(sink_h) + sum_j exp(s_j))``, ``s_k = sm_scale * q . kv[idx_k]``, fp32 math.
    A query with no valid index gets 0 (the sink takes all the weight).
    """
    out = torch.empty_like(q)
    pools = [(kv, indices)] + ([] if extra_kv is None else [(extra_kv, extra_indices)])
    valid = [(idx >= 0) & (idx < pool.shape[0]) for pool, idx in pools]
    safe = [torch.where(ok, idx, 0) for (_, idx), ok in zip(pools, valid)]
    for start in range(0, q.shape[0], QUERY_CHUNK):
        rows = slice(start, start + QUERY_CHUNK)
        keys = torch.cat([pool[idx[rows]] for (pool, _), idx in zip(pools, safe)], dim=1).float()  # [s, K, D]
        probs = sink_probabilities(q[rows], keys, torch.cat([v[rows] for v in valid], dim=1), sinks, sm_scale)
        out[rows] = torch.einsum("shk,skd->shd", probs, keys).to(q.dtype)
    return out


def sink_probabilities(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                       sm_scale: float) -> torch.Tensor:
    """The weights ``p [S, H, K]`` fp32 of :func:`sparse_sink_attention` for queries ``q: [S, H, D]``
    over their gathered rows ``keys: [S, K, D]`` fp32 (``valid: [S, K]`` bool; 0 where False); the
    sink's share is left out, so a row sums to less than 1."""
    scores = torch.einsum("shd,skd->shk", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(scores.shape[0], -1, 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


class RopeTable:
    """One rope type of the model: ``table(positions [S], fused) -> RopeAt``, whose ``rotate_tail``
    turns a head's trailing RoPE dims (the frequencies copied to a device once: a copy per call
    would be a host sync on a GPU). ``fused`` (production inference) rotates in place with one
    kernel; else the differentiable torch expressions (reference mode, training)."""

    def __init__(self, rotary: Rotary):
        self.rotary = rotary

    def __call__(self, positions: torch.Tensor, fused: bool = False) -> RopeAt:
        return self.rotary.at(positions, fused)


@dataclass
class AttentionState:
    """One layer's cache for one sequence: the last ``sliding_window - 1`` raw K=V rows and the
    compressor (and indexer) states of a CSA/HCA layer."""

    window: torch.Tensor | None = None
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)


class GroupedLinear(nn.Module):
    """``weight: [groups * out, in]``: group g's ``in`` features go through rows ``[g*out, (g+1)*out)``."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [S, groups, in]`` -> ``[S, groups * out]``."""
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("sgi,goi->sgo", x, w.to(x.dtype)).flatten(1)


class DeepseekV4Attention(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_type: str):
        super().__init__()
        c = config
        self.layer_type, self.heads, self.head_dim, self.window = layer_type, c.num_attention_heads, c.head_dim, c.sliding_window
        self.eps, self.o_groups = c.rms_norm_eps, c.o_groups
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.o_a_proj = GroupedLinear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_lora_rank, c.o_groups)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(c.num_attention_heads, dtype=torch.float32))
        self.ratio = {CSA: c.csa_ratio, HCA: c.hca_ratio}.get(layer_type, 0)
        if self.ratio:
            self.compressor = Compressor(c.hidden_size, c.head_dim, self.ratio, layer_type == CSA, c.rms_norm_eps)
        if layer_type == CSA:  # transformers' name for it: self_attn.compressor.indexer
            self.compressor.indexer = Indexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                                              c.index_topk, c.csa_ratio, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: AttentionState, rope: RopeTable,
                compress_rope: RopeTable) -> torch.Tensor:
        """``x: [S, hidden]`` the sequence's next tokens at ``positions: [S]`` (consecutive, after the
        ones ``state`` holds) -> ``[S, hidden]``; ``state`` is updated. ``rope`` is this layer's
        RoPE (sliding: main, CSA/HCA: compress), ``compress_rope`` the compressors'."""
        tokens = x.shape[0]
        rope_at = rope(positions)
        q_residual, q, kv = self.project(x, rope_at)
        rows = kv if state.window is None else torch.cat([state.window, kv])
        first = positions[0] - (rows.shape[0] - tokens)  # position of rows[0]
        state.window = rows[rows.shape[0] - min(rows.shape[0], self.window - 1):]
        offsets = torch.arange(self.window, device=x.device) - (self.window - 1)
        window_pos = positions[:, None] + offsets  # [S, window]
        indices = torch.where(window_pos >= 0, window_pos - first, -1)
        pool = rows
        if self.ratio:
            entries = self.compressor(x, state.compressor, compress_rope)  # [N, D]
            if self.layer_type == CSA:
                picked = self.compressor.indexer.select(x, q_residual, positions, state.indexer, compress_rope)
            else:
                entry = torch.arange(entries.shape[0], device=x.device)
                picked = torch.where(entry[None, :] < visible_entries(positions, self.ratio)[:, None], entry, -1)
            indices = torch.cat([indices, torch.where(picked >= 0, picked + rows.shape[0], -1)], dim=1)
            pool = torch.cat([rows, entries])
        return self.output(sparse_sink_attention(q, pool, indices, self.sinks, self.head_dim**-0.5), rope_at)

    def fuse_input_projections(self) -> None:
        """For inference: the projections that read the block's input (q_a, kv, the compressors' kv
        and gate, the indexer's head weights) run as one GEMM per kind, each answering from it
        wherever it is called (``linear.fuse_shared_input``); training and checkpoints see them as before."""
        parts = [self.q_a_proj, self.kv_proj]
        compressor = getattr(self, "compressor", None)
        if compressor is not None:
            parts += [compressor.kv_proj, compressor.gate_proj]
            indexer = getattr(compressor, "indexer", None)
            if indexer is not None:
                parts += [indexer.kv_proj, indexer.gate_proj, indexer.scorer.weights_proj]
        fuse_shared_input(self, parts)

    def run_input_projections(self, x: torch.Tensor) -> None:
        """Run the fused input GEMMs for ``x`` now (after :meth:`fuse_input_projections`; else
        nothing): each part then answers from their outputs, so work forked onto other streams
        after this call reads finished results (``runtime.streams``)."""
        for module in self.children():
            if isinstance(module, FusedLinear):
                module.outputs(x)

    def project(self, x: torch.Tensor, rope_at: RopeAt):
        """``x: [T, hidden]`` with its tokens' RoPE -> (q_residual ``[T, q_lora_rank]``, q ``[T, H, D]``,
        kv ``[T, D]``), q and kv RoPE'd."""
        q_residual = self.q_a_norm(self.q_a_proj(x))
        return (q_residual, *self.query_and_kv(x, q_residual, rope_at))

    def query_and_kv(self, x: torch.Tensor, q_residual: torch.Tensor, rope_at: RopeAt):
        """:meth:`project`'s (q, kv) from its ``q_residual`` (the engine runs the indexer beside them)."""
        q = normalize_heads(self.q_b_proj(q_residual).view(x.shape[0], self.heads, self.head_dim), self.eps)
        return rope_at.rotate_tail(q), rope_at.rotate_tail(self.kv_norm(self.kv_proj(x)))

    def output(self, out: torch.Tensor, rope_at: RopeAt) -> torch.Tensor:
        """Attention output ``[T, H, D]`` -> ``[T, hidden]``: RoPE dims rotated back, grouped projection."""
        out = rope_at.rotate_tail(out, inverse=True)
        return self.o_b_proj(self.o_a_proj(out.view(out.shape[0], self.o_groups, -1)))
