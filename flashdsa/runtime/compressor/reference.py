"""Reference (torch, fp32) DeepSeek-V4 KV compressors: gated softmax pooling of token windows.

Each token brings ``kv: [C]`` and a gate score ``gate + position_bias[p % ratio]: [C]``. A window
of ``ratio`` tokens closes into one entry ``sum_j softmax_j(score_j) * kv_j`` (softmax over the
window's slots, per channel). HCA (``overlap=False``): C = D, the window's own tokens. CSA
(``overlap=True``): C = 2D; the entry of window w pools 2 * ratio slots, the first D channels
("Ca") of window w - 1's tokens and the last D channels ("Cb") of window w's; before the first
window those slots are empty (score -inf, weight 0). This is transformers'
``DeepseekV4{CSA,HCA}Compressor`` up to the pooling; its RMSNorm and RoPE come after, in the model.

State of one sequence (the engine keeps one per sequence and layer): ``kv`` and ``score`` rows
``[W, C]`` fp32, W = 2 * ratio with overlap (rows [0, ratio): the last closed window's tokens,
rows [ratio, 2 ratio): the open window) or ratio without (the open window). The token at position
p sits in row ``W - ratio + p % ratio``; empty rows have score -inf.
"""

from __future__ import annotations

from typing import Optional

import torch


def new_state(batch: int, ratio: int, channels: int, overlap: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty states (kv zeros, score -inf): ``[batch, W, channels]`` fp32 each."""
    rows = 2 * ratio if overlap else ratio
    kv = torch.zeros(batch, rows, channels, dtype=torch.float32, device=device)
    return kv, torch.full_like(kv, float("-inf"))


def _pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """``sum_j softmax_j(score) * kv`` over dim -2; fully empty (-inf) columns give 0."""
    weights = torch.softmax(score, dim=-2).nan_to_num(0.0)
    return (weights * kv.masked_fill(score == float("-inf"), 0.0)).sum(dim=-2)


def _windows(kv: torch.Tensor, score: torch.Tensor, prev_kv: torch.Tensor, prev_score: torch.Tensor,
             ratio: int, overlap: bool) -> torch.Tensor:
    """Entries ``[n, D]`` of the closed windows ``kv, score: [n * ratio, C]``; prev_*: ``[ratio, C]``
    are the window before the first (used with overlap)."""
    n, channels = kv.shape[0] // ratio, kv.shape[-1]
    if n == 0:
        return kv.new_zeros(0, channels // 2 if overlap else channels)
    kv, score = kv.view(n, ratio, channels), score.view(n, ratio, channels)
    if not overlap:
        return _pool(kv, score)
    d = kv.shape[-1] // 2
    before_kv = torch.cat([prev_kv[None, :, :d], kv[:-1, :, :d]])  # window w - 1's Ca
    before_score = torch.cat([prev_score[None, :, :d], score[:-1, :, :d]])
    return _pool(torch.cat([before_kv, kv[..., d:]], dim=1), torch.cat([before_score, score[..., d:]], dim=1))


def compress_sequence(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, overlap: bool,
                      start_pos: int, state_kv: torch.Tensor, state_score: torch.Tensor) -> torch.Tensor:
    """Positions ``start_pos .. start_pos + T - 1`` of one sequence: returns the entries of every
    window they close ``[n, D]`` fp32 and leaves the state ``[W, C]`` (updated in place) ready for
    the next token."""
    ratio = position_bias.shape[0]
    positions = torch.arange(start_pos, start_pos + kv.shape[0], device=kv.device)
    score = gate.float() + position_bias.float()[positions % ratio]
    open_rows = state_kv.shape[0] - ratio
    pending = start_pos % ratio
    all_kv = torch.cat([state_kv[open_rows:open_rows + pending], kv.float()])
    all_score = torch.cat([state_score[open_rows:open_rows + pending], score])
    closed = all_kv.shape[0] // ratio * ratio
    entries = _windows(all_kv[:closed], all_score[:closed], state_kv[:ratio], state_score[:ratio], ratio, overlap)
    if overlap and closed:
        state_kv[:ratio], state_score[:ratio] = all_kv[closed - ratio:closed], all_score[closed - ratio:closed]
    tail = all_kv.shape[0] - closed
    state_kv[open_rows:open_rows + tail], state_score[open_rows:open_rows + tail] = all_kv[closed:], all_score[closed:]
    state_score[open_rows + tail:] = float("-inf")
    state_kv[open_rows + tail:] = 0.0
    return entries


def compress_decode_step(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, position_bias: torch.Tensor,
                         overlap: bool, state_kv: torch.Tensor, state_score: torch.Tensor,
                         state_slots: Optional[torch.Tensor] = None, fresh: Optional[torch.Tensor] = None,
                         out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per sequence: ``kv, gate: [B, C]`` at ``positions: [B]``. Writes it into the
    states ``state_*[state_slots]`` (all of ``state_*: [B, W, C]`` without state_slots; in place), emptied first
    where ``fresh``; returns (entries ``[B, D]`` in ``out_dtype``, closed ``[B]`` bool): the entry is meaningful
    where the token closed its window (``p % ratio == ratio - 1``). No host sync."""
    entries, closed = _slotted_decode_step(kv, gate, positions, position_bias, overlap, state_kv, state_score,
                                           state_slots, fresh)
    return entries.to(out_dtype), closed


def _slotted_decode_step(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, position_bias: torch.Tensor,
                         overlap: bool, state_kv: torch.Tensor, state_score: torch.Tensor,
                         state_slots: Optional[torch.Tensor], fresh: Optional[torch.Tensor],
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compress_decode_step` before the entries' cast."""
    if state_slots is None and fresh is None:
        return _decode_step(kv, gate, positions, position_bias, overlap, state_kv, state_score)
    rows = torch.arange(kv.shape[0], device=kv.device) if state_slots is None else state_slots
    own_kv, own_score = state_kv[rows], state_score[rows]
    if fresh is not None:
        own_kv = torch.where(fresh[:, None, None], 0.0, own_kv)
        own_score = torch.where(fresh[:, None, None], float("-inf"), own_score)
    out = _decode_step(kv, gate, positions, position_bias, overlap, own_kv, own_score)
    state_kv[rows], state_score[rows] = own_kv, own_score
    return out


def _decode_step(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, position_bias: torch.Tensor,
                 overlap: bool, state_kv: torch.Tensor, state_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compress_decode_step` on states ``[B, W, C]`` of the B sequences."""
    ratio = position_bias.shape[0]
    batch, rows, channels = state_kv.shape
    slot = positions.long() % ratio
    row = (rows - ratio + slot).view(batch, 1, 1).expand(batch, 1, channels)
    state_kv.scatter_(1, row, kv.float().unsqueeze(1))
    state_score.scatter_(1, row, (gate.float() + position_bias.float()[slot]).unsqueeze(1))
    closed = slot == ratio - 1
    if overlap:
        d = channels // 2
        slots_kv = torch.cat([state_kv[:, :ratio, :d], state_kv[:, ratio:, d:]], dim=1)
        slots_score = torch.cat([state_score[:, :ratio, :d], state_score[:, ratio:, d:]], dim=1)
        entries = _pool(slots_kv, slots_score)
        shift = closed.view(batch, 1, 1)
        state_kv[:, :ratio] = torch.where(shift, state_kv[:, ratio:], state_kv[:, :ratio])
        state_score[:, :ratio] = torch.where(shift, state_score[:, ratio:], state_score[:, :ratio])
    else:
        entries = _pool(state_kv, state_score)
    opened = closed.view(batch, 1, 1)
    state_kv[:, rows - ratio:] = torch.where(opened, 0.0, state_kv[:, rows - ratio:])
    state_score[:, rows - ratio:] = torch.where(opened, float("-inf"), state_score[:, rows - ratio:])
    return entries, closed
