"""DeepSeek-V4 KV compressors: CSA (overlapping windows of 4, 2D channels in) and HCA (windows of
128, D channels in), as a prefill op over one sequence and a batched decode-step state update.

Both pool a closed window of tokens into one compressed entry with a learned softmax gate (the
equations and the per-sequence state are in ``compressor.reference``); the entry then goes through
the compressor's RMSNorm and RoPE in the model and is written to a V4 cache. The state a sequence
carries between steps is two fp32 tensors ``[W, C]`` (``new_state``): the open window's tokens
and, for CSA, the last closed window's.

Backends: ``reference`` (torch) for both; ``triton`` (CUDA) for the decode step: one kernel reads
and writes the engine's state pool in place (``state_slots``, ``fresh``) and reads a window's rows
only when the token closes it, where the torch step gathers, rewrites and scatters every state.
Both stay CUDA-graph capturable (no host sync).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.checks import can_check_values, check, check_tensor
from flashdsa.runtime.compressor.reference import new_state

__all__ = ["new_state", "compress_sequence", "compress_decode_step"]

FLOATS = (torch.bfloat16, torch.float16, torch.float32)

for _op in ("compress_sequence", "compress_decode_step"):
    dispatch.register(_op, "reference", f"flashdsa.runtime.compressor.reference:{_op}")
dispatch.register("compress_decode_step", "triton", "flashdsa.runtime.compressor.triton.decode_step:compress_decode_step")


def _check_inputs(kv: object, gate: object, position_bias: object, overlap: object, lead: str) -> tuple[int, int]:
    """kv and gate ``[n, C]`` alike, position_bias ``[ratio, C]``; returns (ratio, C)."""
    check(isinstance(overlap, bool), f"overlap must be a bool, got {overlap!r}")
    check_tensor("kv", kv, FLOATS, [None, None], f"bf16/fp16/fp32 [{lead}, C]", contiguous=False)
    n, channels = kv.shape
    check(channels > 0 and (not overlap or channels % 2 == 0),
          f"kv must have C > 0 channels{' (2 D with overlap)' if overlap else ''}, got {list(kv.shape)}")
    check_tensor("gate", gate, FLOATS, [n, channels], f"float [{lead}={n}, C={channels}] like kv", kv.device,
                 contiguous=False)
    check_tensor("position_bias", position_bias, FLOATS, [None, channels], f"float [ratio, C={channels}]", kv.device)
    check(position_bias.shape[0] > 0, f"position_bias must have ratio > 0 rows, got {list(position_bias.shape)}")
    return position_bias.shape[0], channels


def _check_state(state_kv: object, state_score: object, lead: list, ratio: int, channels: int, overlap: bool,
                 device: torch.device) -> None:
    rows = 2 * ratio if overlap else ratio
    expected = f"float32 [{', '.join(str(d) for d in lead + [rows, channels])}] (new_state)"
    for name, t in (("state_kv", state_kv), ("state_score", state_score)):
        check_tensor(name, t, torch.float32, lead + [rows, channels], expected, device)


def compress_sequence(
    kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, overlap: bool, *,
    start_pos: int = 0, state_kv: Optional[torch.Tensor] = None, state_score: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress tokens ``start_pos .. start_pos + T - 1`` of one sequence (prefill, or a chunk of it).

    Args:
        kv: ``[T, C]`` the compressor's kv projection (C = 2 D for CSA, D for HCA).
        gate: ``[T, C]`` its gate projection (position_bias not yet added).
        position_bias: ``[ratio, C]`` the learned bias per position in the window.
        overlap: True for CSA (window w also pools window w - 1's first D channels), False for HCA.
        start_pos: absolute position of the first token (a multiple of nothing: chunks may end
            mid-window); with start_pos > 0 the state must be the one the previous chunk left.
        state_kv, state_score: ``[W, C]`` fp32 state (``new_state(1, ...)[i][0]``); None starts fresh.

    Returns:
        (entries ``[n, D]`` fp32 of the n windows these tokens close, in order; state_kv,
        state_score updated for the next token).
    """
    ratio, channels = _check_inputs(kv, gate, position_bias, overlap, "T")
    check(isinstance(start_pos, int) and not isinstance(start_pos, bool) and start_pos >= 0,
          f"start_pos must be an int >= 0, got {start_pos!r}")
    if state_kv is None and state_score is None:
        check(start_pos == 0, f"start_pos {start_pos} > 0 needs the state the earlier tokens left")
        state_kv, state_score = (t[0] for t in new_state(1, ratio, channels, overlap, kv.device))
    _check_state(state_kv, state_score, [], ratio, channels, overlap, kv.device)
    impl = dispatch.select("compress_sequence", kv.device, backend)
    return impl(kv, gate, position_bias, overlap, start_pos, state_kv, state_score), state_kv, state_score


def compress_decode_step(
    kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, position_bias: torch.Tensor, overlap: bool,
    state_kv: torch.Tensor, state_score: torch.Tensor, *, state_slots: Optional[torch.Tensor] = None,
    fresh: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32, backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one token per sequence to its compressor state; graph-capturable (no host sync).

    Args:
        kv, gate: ``[B, C]`` the new tokens' projections. positions: ``[B]`` int64 their positions.
        position_bias, overlap: as in :func:`compress_sequence`.
        state_kv, state_score: fp32 states (``new_state``), updated in place: ``[B, W, C]``, or with
            ``state_slots`` a pool ``[S, W, C]`` of which sequence b owns row ``state_slots[b]``.
        state_slots: optional ``[B]`` int64 distinct rows in ``[0, S)``.
        fresh: optional ``[B]`` bool: sequence b starts from an empty state (its old row is ignored).
        out_dtype: the entries' dtype (fp32, bf16 or fp16): the fp32 entries rounded once, as their
            ``.to(out_dtype)`` would be, without that cast's kernel (the model norms them in its dtype).

    Returns:
        (entries ``[B, D]`` out_dtype, closed ``[B]`` bool): entry b is a new compressed entry where
        closed[b] (the token ended its window: position % ratio == ratio - 1), else meaningless
        (the triton backend writes 0 there).
    """
    ratio, channels = _check_inputs(kv, gate, position_bias, overlap, "B")
    check(out_dtype in FLOATS, f"out_dtype must be one of bf16/fp16/fp32, got {out_dtype!r}")
    batch = kv.shape[0]
    check_tensor("positions", positions, torch.int64, [batch], f"int64 [B={batch}]", kv.device)
    if fresh is not None:
        check_tensor("fresh", fresh, torch.bool, [batch], f"bool [B={batch}]", kv.device)
    if state_slots is None:
        _check_state(state_kv, state_score, [batch], ratio, channels, overlap, kv.device)
    else:
        check_tensor("state_slots", state_slots, torch.int64, [batch], f"int64 [B={batch}]", kv.device)
        check_tensor("state_kv", state_kv, torch.float32, [None, None, None], "float32 [S, W, C] (new_state)")
        _check_state(state_kv, state_score, [state_kv.shape[0]], ratio, channels, overlap, kv.device)
        if batch and can_check_values(kv.device):
            low, high = int(state_slots.min()), int(state_slots.max())
            check(0 <= low and high < state_kv.shape[0],
                  f"state_slots must lie in [0, {state_kv.shape[0]}), got [{low}, {high}]")
    impl = dispatch.select("compress_decode_step", kv.device, backend)
    return impl(kv, gate, positions, position_bias, overlap, state_kv, state_score, state_slots, fresh, out_dtype)
