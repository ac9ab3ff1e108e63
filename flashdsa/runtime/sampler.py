"""Next-token sampling for a batch of sequences, vectorised over the batch.

Order, as in vLLM: penalties (repetition on prompt + output, presence and frequency on the
output), the structured-output grammars' token bitmask, min_tokens (EOS and stop ids masked
until reached), then greedy rows take the argmax and the rest divide by temperature, keep the
top_k, the top_p nucleus and tokens with p >= min_p * p_max, and sample with the exponential
race argmax(p / q), q ~ Exp(1), drawing q from the request's own generator when it set a seed
(so its tokens do not depend on the batch).
Log-probabilities are those of the raw model distribution, before any of this.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime.sequence import Sequence, TokenLogprobs
from flashdsa.runtime.structured import apply_bitmask


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """counts: [N, vocab] fp32, how often each token occurs in each row."""
    counts = torch.zeros(len(rows), vocab, device=device)
    width = max((len(r) for r in rows), default=0)
    if width == 0:
        return counts
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
    ones = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows], device=device)
    return counts.scatter_add_(1, ids.clamp(0, vocab - 1), ones)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [N, vocab] fp32, penalised in place."""
    params = [s.params for s in seqs]
    if all(p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0 for p in params):
        return logits
    vocab, device = logits.shape[1], logits.device
    output_counts = _token_counts([s.output_token_ids for s in seqs], vocab, device)
    seen = (output_counts + _token_counts([s.token_ids[: s.num_prompt_tokens] for s in seqs], vocab, device)) > 0
    rep = _column([p.repetition_penalty for p in params], torch.float32, device)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits -= _column([p.frequency_penalty for p in params], torch.float32, device) * output_counts
    logits -= _column([p.presence_penalty for p in params], torch.float32, device) * (output_counts > 0)
    return logits


def mask_until_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Forbid EOS and the stop token ids for sequences still short of min_tokens."""
    vocab = logits.shape[1]
    for i, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = list(seq.params.stop_token_ids)
            if seq.eos_token_id is not None and not seq.params.ignore_eos:
                banned.append(seq.eos_token_id)
            banned = [t for t in banned if t < vocab]
            logits[i, banned] = float("-inf")


def filter_top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [N, vocab], already divided by temperature; filtered tokens become -inf."""
    params = [s.params for s in seqs]
    if all(p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0 for p in params):
        return logits
    vocab, device = logits.shape[1], logits.device
    sorted_logits, order = logits.sort(dim=1, descending=True)
    top_k = _column([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, device)
    drop = torch.arange(vocab, device=device).unsqueeze(0) >= top_k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=1)
    top_p = _column([p.top_p for p in params], torch.float32, device)
    drop |= (probs.cumsum(dim=1) - probs) > top_p  # keep the smallest prefix reaching top_p
    min_p = _column([p.min_p for p in params], torch.float32, device)
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_noise(shape: torch.Size, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    q = torch.empty(shape, device=device).exponential_()
    for i, seq in enumerate(seqs):
        if seq.generator is not None:
            q[i] = torch.empty(shape[1]).exponential_(generator=seq.generator).to(device)
    return q


def sample(logits: torch.Tensor, seqs: list[Sequence], token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits: [N, vocab] fp32 raw model output, row i for seqs[i] -> next tokens [N] int64.

    token_bitmask: [N, ceil(vocab / 32)] int32 on the logits' device, the tokens each row's grammar
    allows (runtime/structured.py), or None.
    """
    logits = apply_penalties(logits.clone(), seqs)
    if token_bitmask is not None:
        apply_bitmask(logits, token_bitmask)
    mask_until_min_tokens(logits, seqs)
    greedy_tokens = logits.argmax(dim=1)
    if all(s.params.greedy for s in seqs):
        return greedy_tokens
    device = logits.device
    temperature = _column([max(s.params.temperature, 1e-5) for s in seqs], torch.float32, device)
    probs = filter_top_k_top_p_min_p(logits / temperature, seqs).softmax(dim=1)
    sampled = (probs / _exponential_noise(probs.shape, seqs, device)).argmax(dim=1)
    greedy = torch.tensor([s.params.greedy for s in seqs], device=device)
    return torch.where(greedy, greedy_tokens, sampled)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Raw log-probabilities of targets[i] under row i of logits, with the num_top[i] best.

    logits: [M, vocab] fp32, targets: [M] int64.
    """
    logprobs = logits.float().log_softmax(dim=1)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(max(max(num_top, default=0), 1), dim=1)
    chosen, ranks, targets = chosen.tolist(), ranks.tolist(), targets.tolist()
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(targets[i], chosen[i], ranks[i], dict(zip(top_ids[i][: num_top[i]], top_values[i][: num_top[i]])))
        for i in range(len(targets))
    ]


def sampled_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]
) -> list[Optional[TokenLogprobs]]:
    """Logprobs of the sampled tokens for the sequences that asked (None for the others)."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    result: list[Optional[TokenLogprobs]] = [None] * len(seqs)
    if rows:
        index = torch.tensor(rows, device=logits.device)
        found = token_logprobs(logits[index], tokens[index], [seqs[i].params.logprobs for i in rows])
        for i, lp in zip(rows, found):
            result[i] = lp
    return result
