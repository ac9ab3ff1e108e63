"""The lightning indexer for training: full-sequence scores, causal top-k, scores of the selected keys.

No Hadamard or FP8 (the reference computation), from the model's own indexer projections; the
products run in fp32, or in bf16 under the training loop's autocast on CUDA:

    I[t, s] = D^-0.5 * sum_h w_t[h] relu(q_t[h] . k_s),  s <= t

Selection scores query blocks without gradients, so it never holds more than ``SELECT_CHUNK``
score rows; the sparse stage then differentiates only the scores of the selected keys
(``[B, L, topk]``), never the whole ``[B, L, L]`` matrix. The dense warm-up needs every key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashdsa.runtime.checks import trusted_values
from flashdsa.runtime.indexer import indexer_topk


SELECT_CHUNK = 1024  # queries scored at once when selecting the top-k


@dataclass
class IndexerInputs:
    """q: [B, L, H_I, D], k: [B, L, D], w: [B, L, H_I] (head weights with H_I^-0.5 folded in), fp32."""

    q: torch.Tensor
    k: torch.Tensor
    w: torch.Tensor

    def scores(self, rows: slice, keys: int) -> torch.Tensor:
        """Scores of queries ``rows`` against keys ``[0, keys)``: [B, n, keys] (no causal mask)."""
        dots = F.relu(torch.einsum("bthd,bsd->bths", self.q[:, rows], self.k[:, :keys]) * self.q.shape[-1] ** -0.5)
        return torch.einsum("bth,bths->bts", self.w[:, rows], dots)


def indexer_inputs(indexer, x: torch.Tensor, q_resid: torch.Tensor, rope, batch: int) -> IndexerInputs:
    """Project x: [T, hidden] and q_resid: [T, q_lora_rank] (T = batch * L) with the model's indexer."""
    q, k, w = indexer.project(x, q_resid, rope)
    heads, dim = indexer.n_heads, indexer.head_dim
    q, k = q.float(), k.float()
    return IndexerInputs(q.view(batch, -1, heads, dim), k.view(batch, -1, dim), w.view(batch, -1, heads))


def causal_scores(inputs: IndexerInputs) -> torch.Tensor:
    """Every query against every key: [B, L, L] fp32, -inf where s > t."""
    length = inputs.k.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=inputs.k.device).tril()
    return inputs.scores(slice(None), length).masked_fill(~causal, float("-inf"))


@torch.no_grad()
def select_topk(inputs: IndexerInputs, topk: int) -> torch.Tensor:
    """The top-k causal keys of every query: [B, L, topk] int64 positions, by descending score,
    ties to the lower position, -1 padded. Query blocks go through the inference indexer's top-k
    op (Triton on CUDA) with causal ranges, so no block is masked or sorted."""
    batch, length = inputs.k.shape[:2]
    parts = []
    with trusted_values():  # the ranges below are built here
        for start in range(0, length, SELECT_CHUNK):
            stop = min(length, start + SELECT_CHUNK)
            scores = inputs.scores(slice(start, stop), stop).float().flatten(0, 1)  # [B * n, stop]
            ends = torch.arange(start + 1, stop + 1, dtype=torch.int32, device=scores.device).repeat(batch)
            positions = indexer_topk(scores, topk, torch.zeros_like(ends), ends)
            parts.append(positions.view(batch, stop - start, topk))
    return torch.cat(parts, dim=1).long()


def selected_scores(inputs: IndexerInputs, positions: torch.Tensor) -> torch.Tensor:
    """Differentiable scores of the selected keys: positions [B, L, K] -> [B, L, K] (junk where -1: mask it)."""
    batch, length, topk = positions.shape
    rows = positions.clamp_min(0) + torch.arange(batch, device=positions.device)[:, None, None] * length
    # index_select's backward is an atomic index_add_; advanced indexing's (a sorted index_put_) took
    # half of an L=4096 training step on an H200
    keys = inputs.k.reshape(batch * length, -1).index_select(0, rows.view(-1)).view(batch, length, topk, -1)
    dots = F.relu(torch.einsum("bthd,btkd->bthk", inputs.q, keys) * inputs.q.shape[-1] ** -0.5)
    return torch.einsum("bth,bthk->btk", inputs.w, dots)
