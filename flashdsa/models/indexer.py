"""The lightning indexer of DeepSeek Sparse Attention: which cached tokens each query attends to.

    q_t = rope(W_qb q_resid_t)  [H_I, D]      k_s = rope(LayerNorm(W_k x_s))  [D]
    w_t = W_w x_t * H_I^-0.5     [H_I]
    I[t, s] = D^-0.5 * sum_h w_t[h] * relu(q_t[h] . k_s)        for s <= t (causal)
    selected(t) = top-k_s I[t, s]

RoPE here is rotate-half on the first ``qk_rope_head_dim`` of the D = ``index_head_dim`` dims.
Production rotates q and k by a 128-point Hadamard (orthogonal: scores unchanged up to rounding)
and scores them in FP8 (power-of-two scales, q's folded into w); reference scores in fp32
without either, as Hugging Face does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from flashdsa.models.caches import gather_fp8_keys, gather_rows, store_index_key
from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.rope import RopeAt
from flashdsa.runtime.indexer import indexer_fused_topk, indexer_logits_paged, indexer_topk, rotate_quantize_indexer
from flashdsa.runtime.metadata import BatchMetadata

PAGED_MAX_QUERIES = 4  # queries per sequence up to which the paged (decode) scoring runs


class TopK(nn.Module):
    """``logits: [T, L]`` -> positions of the k best finite scores ``[T, k]`` int32, -1 padded;
    ``ends: [T]`` int32, when given, bounds each row's scan (its scores beyond are -inf or not
    written at all: the paged decode scores leave the positions past a context unwritten);
    ``sorted=False`` leaves them in any order (the attention only gathers them).

    A module so that a forward hook sees both the scores and the choice (the layerwise check)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, logits: torch.Tensor, ends: Optional[torch.Tensor] = None, sorted: bool = True) -> torch.Tensor:
        starts = None if ends is None else torch.zeros_like(ends)
        return indexer_topk(logits, self.k, starts, ends, sorted=sorted)


class Indexer(nn.Module):
    def __init__(self, config: DeepseekV32Config):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.topk = TopK(config.index_topk)

    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        rope: RopeAt,
        meta: BatchMetadata,
        pool: torch.Tensor,
        k_proj: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x: [T, hidden], q_resid: [T, q_lora_rank] -> selected positions [T, index_topk] int32 (-1 pad).
        ``k_proj``: ``wk(x)`` [T, D] when the caller computed it (MLA's fused input projection).

        Writes this step's keys into ``pool`` (the layer's indexer cache) first."""
        q, k, w = self.project(x, q_resid, rope, k_proj)
        store_index_key(pool, k, meta.slot_mapping)
        if pool.dtype == torch.uint8:
            return self._fp8_select(q, w, meta, pool)
        return self.topk(self._exact_logits(q, w, meta, pool))  # [T, topk]

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, rope: RopeAt,
                k_proj: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[T, H_I, D]``, keys ``[T, D]`` (both RoPE'd) and head weights ``[T, H_I]`` fp32
        (``H_I^-0.5`` folded in) of x: [T, hidden], q_resid: [T, q_lora_rank] (``k_proj``: wk(x) if
        already computed); shared with training."""
        q = self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim)
        k_proj = self.wk(x) if k_proj is None else k_proj
        q, k = rope(q, self.k_norm(k_proj), interleaved=False)  # the first qk_rope_head_dim dims rotated
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        return q, k, w

    def _exact_logits(self, q: torch.Tensor, w: torch.Tensor, meta: BatchMetadata, pool: torch.Tensor) -> torch.Tensor:
        """fp32 scores, no Hadamard or FP8 (Hugging Face's computation): ``[T, max_context]``."""
        ranges = meta.sequence_ranges()
        logits = q.new_full((q.shape[0], max(n for _, _, n in ranges)), float("-inf"), dtype=torch.float32)
        for b, (t0, t1, length) in enumerate(ranges):
            keys = gather_rows(pool[:, :, 0], meta.block_tables[b], length).float()  # [L, D]
            dots = F.relu(torch.matmul(q[t0:t1].float(), keys.T) * self.head_dim**-0.5)  # [n, H_I, L]
            scores = torch.matmul(w[t0:t1, None, :], dots).squeeze(1)  # [n, L]
            causal = torch.arange(length, device=q.device)[None, :] <= meta.positions[t0:t1, None]
            logits[t0:t1, :length] = scores.masked_fill(~causal, float("-inf"))
        return logits

    def _fp8_select(self, q: torch.Tensor, w: torch.Tensor, meta: BatchMetadata, pool: torch.Tensor) -> torch.Tensor:
        """Hadamard + FP8 scores over the indexer cache, then top-k: ``[T, topk]`` positions."""
        return fp8_select(q, w * self.head_dim**-0.5, pool, KeyRanges.of_tokens(meta), self.topk)


@dataclass
class KeyRanges:
    """Which cached keys a step's queries score: sequence b has ``lengths_host[b]`` keys
    (``lengths: [B]`` int32 on the device) in the pages of ``block_tables[b]``; query t scores keys
    ``[0, ends[t])`` (``ends: [T]`` int32); ``max_length`` >= every length (host int). ``paged_queries``:
    queries per sequence up to which a step of equal counts may score the pages in one call (that
    kernel's causal rule, query j of n at key ``length - n + j``, must agree with ``ends``)."""

    lengths: torch.Tensor
    lengths_host: tuple[int, ...]
    ends: torch.Tensor
    max_length: int
    query_lens: tuple[int, ...]
    block_tables: torch.Tensor
    paged_queries: int = PAGED_MAX_QUERIES

    @classmethod
    def of_tokens(cls, meta: BatchMetadata) -> "KeyRanges":
        """One key per cached token, causal (V3.2)."""
        return cls(meta.context_lens, meta.context_lens_host, (meta.positions + 1).to(torch.int32),
                   meta.max_context_len, meta.query_lens, meta.block_tables)


def fp8_select(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, keys: KeyRanges, topk: TopK) -> torch.Tensor:
    """Top-k of the Hadamard + FP8 scores of ``q: [T, H, D]`` (head weights ``w: [T, H]`` fp32, every
    constant folded in) over an FP8 indexer pool: ``[T, topk.k]`` int32 key positions, -1 padded.

    Decode-sized steps (every sequence with the same few queries) score the pages in one call;
    otherwise each sequence's keys are gathered and scored and selected chunk by chunk, so no
    whole ``[T, context]`` logits row is ever materialised (a 128K prefill would need 64 GB)."""
    heads, dim = q.shape[1:]
    q_fp8, q_scale = rotate_quantize_indexer(q)  # [T, H, D] e4m3, [T, H]
    w = w * q_scale
    counts = set(keys.query_lens)
    if len(counts) == 1 and max(counts) <= keys.paged_queries:
        q_fp8 = q_fp8.view(len(keys.query_lens), counts.pop(), heads, dim)
        lengths = keys.lengths.clamp_min(q_fp8.shape[1])  # keys past ``ends`` are not selected
        # rows are max_length wide (a CUDA graph's: max_model_len); the top-k reads each up to its end
        logits = indexer_logits_paged(q_fp8, w, pool, lengths, keys.block_tables, max(keys.max_length, q_fp8.shape[1]),
                                      fill_past_context=False)
        return topk(logits, keys.ends, sorted=False)
    out = torch.empty(q.shape[0], topk.k, dtype=torch.int32, device=q.device)
    first = 0
    for b, (n, length) in enumerate(zip(keys.query_lens, keys.lengths_host)):
        k_fp8, k_scale = gather_fp8_keys(pool, keys.block_tables[b], length)  # [L, D], [L]
        ends = keys.ends[first:first + n]
        out[first:first + n] = indexer_fused_topk(q_fp8[first:first + n], w[first:first + n], k_fp8, k_scale,
                                                  torch.zeros_like(ends), ends, topk.k)
        first += n
    return out
