"""The DSA training losses: language modelling, the indexer's KL to the main attention, and the
MTP layer's distillation toward the main model.

The indexer learns to imitate the main attention: for query t, the target p_t is the main
attention probability of each key summed over heads and L1-normalised, and the loss is
KL(p_t || softmax(I_t)) with I_t the indexer scores. Dense warm-up takes it over every causal
key; the sparse stage over the top-k keys the indexer selected. Targets are always detached.

The MTP layer drafts token i + 2 from position i; speculative decoding keeps the draft when it is
the main model's own choice at position i + 1 (greedy) or by rejection sampling against the main
model's distribution there. So besides the data's token (``lm_loss``) the layer can learn that
distribution itself: KL(main_{i+1} || mtp_i), the main logits detached (self-distillation, as
EAGLE-style drafters are trained), and ``top1_agreement`` measures the greedy acceptance it buys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TARGET_CHUNK = 1024  # queries per chunk when gathering selected keys for the sparse target


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits: [B, L, V] (any float), targets: [B, L] int64."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of T^2 * KL(softmax(teacher / T) || softmax(student / T)).

    student, teacher: [..., V] logits (any float; the teacher detached here). The T^2 factor keeps
    the gradient's scale about that of T = 1 (Hinton et al.), so a weight means the same at any T.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_p = torch.log_softmax(teacher.detach().float() / temperature, dim=-1)
    log_q = torch.log_softmax(student.float() / temperature, dim=-1)
    terms = log_p.exp() * (log_p - log_q)
    return terms.sum(-1).mean() * temperature**2


@torch.no_grad()
def top1_agreement(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Share of positions where the two argmaxes agree (fp32 scalar). student, teacher: [..., V] logits."""
    return (student.argmax(-1) == teacher.argmax(-1)).float().mean()


def indexer_kl(target: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target_t || softmax(scores_t)) over the valid keys of each query.

    target: [..., N] >= 0 (normalised here, so any positive scale is fine; detached),
    scores: [..., N] indexer scores, valid: [..., N] bool (False: not a candidate key).
    """
    target = target.detach().float().masked_fill(~valid, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(scores.float().masked_fill(~valid, float("-inf")), dim=-1)
    terms = torch.xlogy(target, target) - target * log_q.masked_fill(~valid, 0.0)
    return terms.sum(-1).mean()


@torch.no_grad()
def dense_attention_target(q: torch.Tensor, kv: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Causal attention probabilities summed over heads, L1-normalised.

    q: [B, L, H, d_qk], kv: [B, L, d_qk] -> [B, L, L] fp32 (row t sums to 1 over keys s <= t).
    """
    length = q.shape[1]
    scores = torch.einsum("bthc,bsc->bths", q.float(), kv.float()) * sm_scale
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal[:, None, :], float("-inf")), dim=-1)
    return probs.sum(2) / q.shape[2]


@torch.no_grad()
def selected_attention_target(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Sparse attention probabilities of the selected keys, summed over heads, L1-normalised.

    q: [T, H, d_qk], kv: [S, d_qk], indices: [T, K] int (rows of kv; invalid < 0),
    lse: [T, H] fp32 from the sparse forward -> [T, K] fp32 (0 at invalid indices).
    """
    parts = []
    for start in range(0, q.shape[0], TARGET_CHUNK):
        rows = slice(start, start + TARGET_CHUNK)
        idx = indices[rows].long()
        valid = (idx >= 0) & (idx < kv.shape[0])
        keys = kv[idx.clamp(0, kv.shape[0] - 1)].float()  # [t, K, d_qk]
        scores = torch.einsum("thc,tkc->thk", q[rows].float(), keys) * sm_scale
        probs = torch.exp(scores - lse[rows, :, None]).sum(1).masked_fill(~valid, 0.0)
        parts.append(probs / probs.sum(-1, keepdim=True).clamp_min(1e-30))
    return torch.cat(parts)
