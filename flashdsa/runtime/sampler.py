"""Next-token sampling for a batch of sequences, vectorised over the batch.

Order, as in vLLM: logit_bias, penalties (repetition on prompt + output, presence and frequency on
the output), the structured-output grammars' token bitmask, min_tokens (EOS and stop ids masked
until reached), then greedy rows take the argmax and the rest divide by temperature, keep the
top_k, the top_p nucleus and tokens with p >= min_p * p_max, and sample with the exponential
race argmax(p / q), q ~ Exp(1), drawing q from the request's own generator when it set a seed
(so its tokens do not depend on the batch). Log-probabilities are those of the raw model distribution, before any of this.

Everything runs batched on the logits' device: per-request values travel in a few host-to-device
copies per step (never one per request), and nothing is read back until the caller takes the tokens.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Union

import torch

from flashdsa.runtime.argmax import argmax_rows
from flashdsa.runtime.sequence import Sequence, TokenLogprobs
from flashdsa.runtime.structured import apply_bitmask
from flashdsa.runtime.transfer import tensor_on, to_device

logger = logging.getLogger(__name__)

Sampled = tuple[int, Optional[TokenLogprobs]]


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return tensor_on(values, dtype, device).unsqueeze(1)


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """counts: [N, vocab] fp32, how often each token occurs in each row."""
    counts = torch.zeros(len(rows), vocab, device=device)
    width = max((len(r) for r in rows), default=0)
    if width == 0:
        return counts
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
    ones = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows], device=device)
    return counts.scatter_add_(1, ids.clamp(0, vocab - 1), ones)


def penalised(seq: Sequence) -> bool:
    """Whether seq's row has repetition, presence or frequency penalties (they count its tokens)."""
    p = seq.params
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def _short_of_min_tokens(seq: Sequence) -> bool:
    """Its next token comes before min_tokens (counting the tokens a step in flight samples)."""
    return seq.num_output_tokens + seq.num_pending_tokens < seq.params.min_tokens


def adjusts_logits(seq: Sequence) -> bool:
    """Whether ``adjust_logits`` changes seq's row: a logit bias, penalties, a grammar, or EOS and
    the stop ids held back until min_tokens."""
    return bool(seq.params.logit_bias) or penalised(seq) or seq.matcher is not None or _short_of_min_tokens(seq)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [N, vocab] fp32, penalised in place."""
    if not any(penalised(s) for s in seqs):
        return logits
    params = [s.params for s in seqs]
    vocab, device = logits.shape[1], logits.device
    output_counts = _token_counts([s.output_token_ids for s in seqs], vocab, device)
    seen = (output_counts + _token_counts([s.token_ids[: s.num_prompt_tokens] for s in seqs], vocab, device)) > 0
    rep = _column([p.repetition_penalty for p in params], torch.float32, device)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, scaled, logits)
    logits -= _column([p.frequency_penalty for p in params], torch.float32, device) * output_counts
    logits -= _column([p.presence_penalty for p in params], torch.float32, device) * (output_counts > 0)
    return logits


def _request_tensors(seq: Sequence, name: str, device: torch.device, build: Callable[[], dict[int, float]]):
    """(ids [K] int64, values [K] fp32) of build()'s {token id: value} for one request on device,
    built on its first step and kept in seq.sampler_tensors: later steps copy nothing per request."""
    cached = seq.sampler_tensors.get(name)
    if cached is None:
        entries = build()
        cached = seq.sampler_tensors[name] = (tensor_on(list(entries), torch.int64, device),
                                              tensor_on(list(entries.values()), torch.float32, device))
    return cached


def _put_rows(logits: torch.Tensor, rows: list[int], parts: list[tuple[torch.Tensor, torch.Tensor]], accumulate: bool) -> None:
    """logits[rows[i], ids_i] = values_i (+= when accumulate) for parts[i] = (ids_i, values_i), one op."""
    if not rows:
        return
    device = logits.device
    lengths = torch.tensor([len(ids) for ids, _ in parts])
    row_index = to_device(torch.repeat_interleave(torch.tensor(rows), lengths), device)
    token_index = torch.cat([ids for ids, _ in parts])
    logits.index_put_((row_index, token_index), torch.cat([values for _, values in parts]), accumulate=accumulate)


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Add each request's logit_bias to its row of logits [N, vocab], in place."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logit_bias]
    parts = [_request_tensors(seqs[i], "logit_bias", logits.device, lambda: seqs[i].params.logit_bias) for i in rows]
    _put_rows(logits, rows, parts, accumulate=True)


def _min_tokens_banned(seq: Sequence) -> dict[int, float]:
    """EOS (unless ignored) and the stop token ids, each with -inf."""
    banned = dict.fromkeys(seq.params.stop_token_ids, float("-inf"))
    if seq.eos_token_id is not None and not seq.params.ignore_eos:
        banned[seq.eos_token_id] = float("-inf")
    return banned


def mask_until_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Forbid EOS and the stop token ids for sequences still short of min_tokens."""
    rows = [i for i, seq in enumerate(seqs) if _short_of_min_tokens(seq)]
    parts = [_request_tensors(seqs[i], "min_tokens", logits.device, lambda: _min_tokens_banned(seqs[i])) for i in rows]
    _put_rows(logits, rows, parts, accumulate=False)


def filter_top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [N, vocab], already divided by temperature; filtered tokens become -inf."""
    params = [s.params for s in seqs]
    if all(p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0 for p in params):
        return logits
    vocab, device = logits.shape[1], logits.device
    sorted_logits, order = logits.sort(dim=1, descending=True)
    top_k = _column([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.int64, device)
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
    """q ~ Exp(1) [N, vocab]; the rows of seeded requests from their own generators (on the host,
    so they do not depend on the device), sent in one copy."""
    q = torch.empty(shape, device=device).exponential_()
    seeded = [i for i, seq in enumerate(seqs) if seq.generator is not None]
    if seeded:
        rows = torch.stack([torch.empty(shape[1]).exponential_(generator=seqs[i].generator) for i in seeded])
        q[tensor_on(seeded, torch.int64, device)] = to_device(rows, device)
    return q


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence], token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A copy of ``logits: [N, vocab]`` fp32 with the logit bias, penalties, the grammars' bitmask
    and min_tokens applied."""
    logits = logits.clone()
    apply_logit_bias(logits, seqs)
    logits = apply_penalties(logits, seqs)
    if token_bitmask is not None:
        apply_bitmask(logits, token_bitmask)
    mask_until_min_tokens(logits, seqs)
    return logits


def sampling_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The distribution ``[N, vocab]`` a sampled row draws from: adjusted ``logits`` divided by the
    temperature, filtered by top_k / top_p / min_p, softmaxed."""
    temperature = _column([max(s.params.temperature, 1e-5) for s in seqs], torch.float32, logits.device)
    return filter_top_k_top_p_min_p(logits / temperature, seqs).softmax(dim=1)


def draw(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One token per row of ``probs: [N, vocab]`` (exponential race; seeded rows use their generator)."""
    return argmax_rows(probs / _exponential_noise(probs.shape, seqs, probs.device))


def sample(logits: torch.Tensor, seqs: list[Sequence], token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits: [N, vocab] fp32 raw model output, row i for seqs[i] -> next tokens [N] int64.

    token_bitmask: [N, ceil(vocab / 32)] int32 on the logits' device, the tokens each row's grammar
    allows (runtime/structured.py), or None.
    """
    logits = adjust_logits(logits, seqs, token_bitmask)
    greedy_tokens = argmax_rows(logits)
    if all(s.params.greedy for s in seqs):
        return greedy_tokens
    sampled = draw(sampling_probs(logits, seqs), seqs)
    greedy = tensor_on([s.params.greedy for s in seqs], torch.bool, logits.device)
    return torch.where(greedy, greedy_tokens, sampled)


def logprob_tensors(logits: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[torch.Tensor]:
    """On the logits' device, without reading anything back: [targets [M], their raw logprobs [M],
    their ranks [M], the best max(num_top) logprobs [M, k] and their token ids [M, k]].

    logits: [M, vocab] fp32, targets: [M] int64.
    """
    logprobs = logits.float().log_softmax(dim=1)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(max(max(num_top, default=0), 1), dim=1)
    return [targets, chosen, ranks, top_values, top_ids]


def as_token_logprobs(tensors: list[torch.Tensor], num_top: list[int]) -> list[TokenLogprobs]:
    """``logprob_tensors``' output (host or device) as one TokenLogprobs per row."""
    targets, chosen, ranks, top_values, top_ids = (t.tolist() for t in tensors)
    return [
        TokenLogprobs(targets[i], chosen[i], ranks[i], dict(zip(top_ids[i][: num_top[i]], top_values[i][: num_top[i]])))
        for i in range(len(targets))
    ]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Raw log-probabilities of targets[i] under row i of logits [M, vocab], with the num_top[i] best."""
    return as_token_logprobs(logprob_tensors(logits, targets, num_top), num_top)


def sampled_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]
) -> list[Optional[TokenLogprobs]]:
    """Logprobs of the sampled tokens for the sequences that asked (None for the others)."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    result: list[Optional[TokenLogprobs]] = [None] * len(seqs)
    if rows:
        index = tensor_on(rows, torch.int64, logits.device)
        found = token_logprobs(logits[index], tokens[index], [seqs[i].params.logprobs for i in rows])
        for i, lp in zip(rows, found):
            result[i] = lp
    return result


def _sample_batch(logits: torch.Tensor, seqs: list[Sequence], token_bitmask: Optional[torch.Tensor]) -> list[Sampled]:
    tokens = sample(logits, seqs, token_bitmask)
    return list(zip(tokens.tolist(), sampled_logprobs(logits, tokens, seqs)))


def sample_each(
    logits: torch.Tensor, seqs: list[Sequence], token_bitmask: Optional[torch.Tensor] = None
) -> list[Union[Sampled, Exception]]:
    """(next token, its logprobs or None) per row of logits [N, vocab], sampled as one batch
    (token_bitmask as in sample()).

    If the batch fails, each row is sampled alone, so a request whose parameters break the
    sampler gets its own exception and the other rows their tokens: one request never fails a step.
    """
    try:
        return _sample_batch(logits, seqs, token_bitmask)
    except Exception:
        logger.exception("batched sampling failed; sampling its %d rows one at a time", len(seqs))
    results: list[Union[Sampled, Exception]] = []
    for i, seq in enumerate(seqs):
        try:
            row_mask = None if token_bitmask is None else token_bitmask[i : i + 1]
            results += _sample_batch(logits[i : i + 1], [seq], row_mask)
        except Exception as exc:
            results.append(exc)
    return results
