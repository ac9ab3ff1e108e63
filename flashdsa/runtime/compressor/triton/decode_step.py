"""The compressor's decode-step state update in Triton: one program per (sequence, block of entry
channels), on the engine's state pool in place.

State rows per sequence (``compressor.reference``): W = 2 ratio with overlap (rows [0, ratio): the
last closed window, [ratio, W): the open one), else W = ratio (the open window). A token that does
not close its window costs one row write (plus, for a fresh sequence, emptying the rest); a token
that closes it reads the open window (and with overlap the previous one), pools it with the
per-channel softmax gate, then with overlap moves the open window to the previous rows, and empties
the open window. Each program owns its channels in every row, so no two programs touch one address.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 1024  # window rows x channels per program


@triton.jit
def _tile(state_ptr, at, row_ok, empty):
    return tl.load(state_ptr + at, mask=row_ok, other=empty)


@triton.jit
def _token(kv_ptr, gate_ptr, bias_ptr, cols, c_ok, slot, channels):
    """The new token's kv and gate score (gate + position bias) at ``cols``, fp32."""
    kv = tl.load(kv_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    return kv, gate + tl.load(bias_ptr + slot * channels + cols, mask=c_ok, other=0.0).to(tl.float32)


@triton.jit
def _store_pair(state_kv_ptr, state_score_ptr, at, kv, score, mask):
    tl.store(state_kv_ptr + at, kv, mask=mask)
    tl.store(state_score_ptr + at, score, mask=mask)


@triton.jit
def _decode_step_kernel(kv_ptr, gate_ptr, pos_ptr, bias_ptr, slots_ptr, fresh_ptr, state_kv_ptr, state_score_ptr,
                        entries_ptr, closed_ptr, stride_kv, stride_gate, dim, RATIO: tl.constexpr, RP: tl.constexpr,
                        OVERLAP: tl.constexpr, SLOTS: tl.constexpr, FRESH: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = c < dim
    r = tl.arange(0, RP)
    channels = 2 * dim if OVERLAP else dim
    rows = 2 * RATIO if OVERLAP else RATIO
    position = tl.load(pos_ptr + b)
    slot = position % RATIO
    closed = slot == RATIO - 1
    fresh = slot < 0  # a false i1
    if FRESH:
        fresh = tl.load(fresh_ptr + b) != 0
    owner = b.to(tl.int64)
    if SLOTS:
        owner = tl.load(slots_ptr + b)
    base = owner * rows * channels
    here = (r[:, None] < RATIO) & c_ok[None, :]  # [RP, BC] the window's rows
    token_row = r[:, None] == slot
    read = here & closed & ~fresh  # a closing token reads its window(s); the others only write
    # the open window at channels hi (c + dim with overlap), the new token substituted in registers
    hi = c + dim if OVERLAP else c
    open_at = base + (rows - RATIO + r[:, None]) * channels
    new_kv, new_score = _token(kv_ptr + b * stride_kv, gate_ptr + b * stride_gate, bias_ptr, hi, c_ok, slot, channels)
    kv_hi = tl.where(token_row, new_kv[None, :], _tile(state_kv_ptr, open_at + hi[None, :], read, 0.0))
    score_hi = tl.where(token_row, new_score[None, :], _tile(state_score_ptr, open_at + hi[None, :], read, float("-inf")))
    score_hi = tl.where(here, score_hi, float("-inf"))
    top = tl.max(score_hi, 0)
    if OVERLAP:  # the previous window's channels c are pooled too
        prev_at = base + r[:, None] * channels
        kv_prev = _tile(state_kv_ptr, prev_at + c[None, :], read, 0.0)
        score_prev = _tile(state_score_ptr, prev_at + c[None, :], read, float("-inf"))
        top = tl.maximum(top, tl.max(score_prev, 0))
    top = tl.where(top == float("-inf"), 0.0, top)
    weight_hi = tl.where(score_hi == float("-inf"), 0.0, tl.exp(score_hi - top[None, :]))
    total = tl.sum(weight_hi, 0)
    if OVERLAP:
        weight_prev = tl.where(score_prev == float("-inf"), 0.0, tl.exp(score_prev - top[None, :]))
        total += tl.sum(weight_prev, 0)
    total = tl.where(total == 0.0, 1.0, total)
    entry = tl.sum(weight_hi / total[None, :] * kv_hi, 0)
    keep = token_row & ~closed  # the token's row, where its window stays open
    emptied = here & (keep | closed | fresh)  # written rows of the open window
    _store_pair(state_kv_ptr, state_score_ptr, open_at + hi[None, :], tl.where(keep, new_kv[None, :], 0.0),
                tl.where(keep, new_score[None, :], float("-inf")), emptied)
    if OVERLAP:  # a closed window moves to the previous rows (a fresh sequence's previous rows empty)
        entry += tl.sum(weight_prev / total[None, :] * kv_prev, 0)
        new_lo, new_score_lo = _token(kv_ptr + b * stride_kv, gate_ptr + b * stride_gate, bias_ptr, c, c_ok, slot,
                                      channels)
        kv_lo = tl.where(token_row, new_lo[None, :], _tile(state_kv_ptr, open_at + c[None, :], read, 0.0))
        score_lo = tl.where(token_row, new_score_lo[None, :],
                            _tile(state_score_ptr, open_at + c[None, :], read, float("-inf")))
        moved = here & (closed | fresh)
        _store_pair(state_kv_ptr, state_score_ptr, prev_at + c[None, :], tl.where(closed, kv_lo, 0.0),
                    tl.where(closed, score_lo, float("-inf")), moved)
        _store_pair(state_kv_ptr, state_score_ptr, prev_at + hi[None, :], tl.where(closed, kv_hi, 0.0),
                    tl.where(closed, score_hi, float("-inf")), moved)
        _store_pair(state_kv_ptr, state_score_ptr, open_at + c[None, :], tl.where(keep, new_lo[None, :], 0.0),
                    tl.where(keep, new_score_lo[None, :], float("-inf")), emptied)
    entry = tl.where(closed, entry, 0.0).to(entries_ptr.dtype.element_ty)  # one rounding to the entries' dtype
    tl.store(entries_ptr + b.to(tl.int64) * dim + c, entry, mask=c_ok)
    if tl.program_id(1) == 0:
        tl.store(closed_ptr + b, closed.to(tl.uint8))


def compress_decode_step(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, position_bias: torch.Tensor,
                         overlap: bool, state_kv: torch.Tensor, state_score: torch.Tensor,
                         state_slots: Optional[torch.Tensor] = None, fresh: Optional[torch.Tensor] = None,
                         out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    batch, channels = kv.shape
    ratio = position_bias.shape[0]
    dim = channels // 2 if overlap else channels
    entries = torch.empty(batch, dim, dtype=out_dtype, device=kv.device)
    closed = torch.empty(batch, dtype=torch.uint8, device=kv.device)
    if batch == 0:
        return entries, closed.view(torch.bool)
    kv, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, gate))
    padded = max(2, triton.next_power_of_2(ratio))
    block = min(max(16, triton.next_power_of_2(dim)), max(16, TILE_ELEMENTS // padded))
    _decode_step_kernel[(batch, triton.cdiv(dim, block))](
        kv, gate, positions, position_bias, positions if state_slots is None else state_slots,
        positions if fresh is None else fresh.view(torch.uint8), state_kv, state_score, entries, closed, kv.stride(0),
        gate.stride(0), dim, RATIO=ratio, RP=padded, OVERLAP=overlap, SLOTS=state_slots is not None,
        FRESH=fresh is not None, BC=block, num_warps=4)
    return entries, closed.view(torch.bool)
