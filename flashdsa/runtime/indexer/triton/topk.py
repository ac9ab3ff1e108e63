"""Indexer top-k in Triton: a radix select of the threshold split over many programs per row,
then one program per row that finishes the selection among a few candidates and sorts it.

Scores map to order-preserving 32-bit keys. A row is cut into splits of ``split`` columns, one
program each (so 128 rows of 128K keep the whole GPU busy):
1. every split histograms the top byte of its keys (a block histogram merged into the row's 256
   bins with one atomic per bin);
2. every split counts, one atomic each, the second byte of the keys whose top byte is the
   threshold's (a few percent of the row);
3. every split appends the columns whose top 16 bits lie above the threshold's to the row's
   selected list, and those level with them to its candidate list (usually a few dozen), each
   entry claiming its slot with one atomic;
4. one program per row runs 8-bit radix passes over the candidates on the 64-bit key
   ``(order key, ~column)``, unique per candidate, so exactly the needed ones are taken with ties
   to the lower column (the four column passes run only when the threshold key is tied); the
   selected list is then sorted by key descending, position ascending, in registers.
The row is read three times; only the selection is sorted. On an H200, 128 rows of 128K take
0.12 ms in passes 1-2, 0.07 ms in pass 3 and 0.07 ms in pass 4 (0.04 of it the sort).

The fused score + top-k walks the keys ``chunk`` at a time: the ragged logits kernel writes a
chunk's scores next to the running top-k (values and positions), and the same passes select from
both, so no whole logits row is ever held. Its memory is ``O(rows * (topk + chunk))`` with rows
processed in groups that bound it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from flashdsa.runtime.indexer.triton.logits import ragged_logits_into

BLOCK = 2048  # scores per step of a pass
MAX_TOPK = 8192  # the selected pairs are sorted in registers
SCRATCH_BYTES = 256 << 20  # candidate lists (and fused scores) of the rows one launch handles
# per-row scratch (int32): two 256-bin histograms, then the selected and candidate counts
SECOND_BINS = tl.constexpr(256)
SELECTED_COUNT = tl.constexpr(512)
CANDIDATE_COUNT = tl.constexpr(513)
SCRATCH_COLS = tl.constexpr(514)


@triton.jit
def _order_key(x):
    """fp32 -> uint32 whose unsigned order is the float order (-0.0 counts as +0.0: a tie)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    sign = tl.full([], 0x80000000, tl.uint32)
    ones = tl.full([], 0xFFFFFFFF, tl.uint32)  # x ^ ones, not ~x: the interpreter cannot invert uint32
    return tl.where((u & sign) == 0, u | sign, u ^ ones)


@triton.jit
def _from_order_key(key):
    sign = tl.full([], 0x80000000, tl.uint32)
    ones = tl.full([], 0xFFFFFFFF, tl.uint32)
    return tl.where((key & sign) != 0, key ^ sign, key ^ ones).to(tl.float32, bitcast=True)


@triton.jit
def _tie_key(key, pos):
    """64-bit ``(order key, ~position)``: descending order is score descending, then the lower
    position first; unique per position."""
    low = tl.full([], 0xFFFFFFFF, tl.uint32)
    return (key.to(tl.uint64) << 32) | (low - pos.to(tl.uint32)).to(tl.uint64)


@triton.jit
def _load_keys(row_ptr, cols, inside):
    """Order keys of ``row_ptr[cols]`` and which are usable: inside and a finite score (NaN and
    +-inf are never selected)."""
    x = tl.load(row_ptr + cols, mask=inside, other=float("-inf"))
    return _order_key(x), inside & (tl.abs(x) < float("inf"))


@triton.jit
def _pick_digit(hist, need):
    """The bin of a 256-bin histogram that holds the need-th largest entry, how many entries lie
    in higher bins, and ``need`` capped at the number of entries."""
    need = tl.minimum(need, tl.sum(hist, 0))
    at_or_above = tl.cumsum(hist, 0, reverse=True)
    bins = tl.arange(0, 256)
    digit = tl.max(tl.where(at_or_above >= need, bins, 0), 0)
    return digit, tl.sum(tl.where(bins > digit, hist, 0), 0), need


@triton.jit
def _threshold_top(scratch_ptr, topk, BOTH_BYTES: tl.constexpr):
    """The top byte (or top 16 bits) of the k-th largest key from the row's histograms, and how
    many keys to take at that prefix (``topk`` less those above it, capped by what exists)."""
    bins = tl.arange(0, 256)
    digit, above, need = _pick_digit(tl.load(scratch_ptr + bins), topk)
    prefix = digit.to(tl.uint32)
    need -= above
    if BOTH_BYTES:
        digit, above, need = _pick_digit(tl.load(scratch_ptr + SECOND_BINS + bins), need)
        prefix = (prefix << 8) | digit.to(tl.uint32)
        need -= above
    return prefix, need


@triton.jit
def _split_span(starts_ptr, ends_ptr, col_lo, col_hi, row, split, RANGES: tl.constexpr, SPLIT: tl.constexpr):
    """Columns [lo, hi) of this program: the row's range cut to split ``split``."""
    if RANGES:
        lo = tl.load(starts_ptr + row)
        hi = tl.load(ends_ptr + row)
    else:
        lo = col_lo
        hi = col_hi
    first = split * SPLIT
    return tl.maximum(lo, first), tl.minimum(hi, first + SPLIT)


@triton.jit
def _histogram_kernel(vals_ptr, stride_v, starts_ptr, ends_ptr, col_lo, col_hi, scratch_ptr, topk,
                      SECOND: tl.constexpr, RANGES: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Passes 1 and 2 over one split, into the row's histograms: the top byte of every usable key
    (a block histogram, merged once), or (SECOND) the second byte of the few keys whose top byte
    is the threshold's (one atomic each)."""
    row = tl.program_id(0).to(tl.int64)
    lo, hi = _split_span(starts_ptr, ends_ptr, col_lo, col_hi, row, tl.program_id(1), RANGES, SPLIT)
    row_ptr = vals_ptr + row * stride_v
    scratch_ptr += row * SCRATCH_COLS
    if SECOND:
        top, _ = _threshold_top(scratch_ptr, topk, False)
    hist = tl.zeros([256], tl.int32)
    for c in range(lo, hi, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        key, ok = _load_keys(row_ptr, cols, cols < hi)
        if SECOND:
            digit = ((key >> 16) & 255).to(tl.int32)
            tl.atomic_add(scratch_ptr + SECOND_BINS + digit, tl.full([BLOCK], 1, tl.int32),
                          mask=ok & ((key >> 24) == top))
        else:
            hist += tl.histogram((key >> 24).to(tl.int32), 256, mask=ok)
    if not SECOND:
        tl.atomic_add(scratch_ptr + tl.arange(0, 256), hist, mask=hist > 0)


@triton.jit
def _append(list_ptr, count_ptr, cols, take):
    """Store ``cols[take]`` at the end of a list that several programs share: each taken entry
    claims its slot from the list's length at ``count_ptr`` with one atomic (entries are few)."""
    slot = tl.atomic_add(count_ptr + tl.zeros_like(cols), tl.full(cols.shape, 1, tl.int32), mask=take)
    tl.store(list_ptr + slot, cols, mask=take)


@triton.jit
def _collect_kernel(vals_ptr, stride_v, starts_ptr, ends_ptr, col_lo, col_hi, scratch_ptr, topk,
                    sel_ptr, cand_ptr, stride_cand,
                    RANGES: tl.constexpr, SPLIT: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 3 over one split: columns above the threshold's top 16 bits join the selected list,
    those level with them the candidate list."""
    row = tl.program_id(0).to(tl.int64)
    lo, hi = _split_span(starts_ptr, ends_ptr, col_lo, col_hi, row, tl.program_id(1), RANGES, SPLIT)
    row_ptr = vals_ptr + row * stride_v
    scratch_ptr += row * SCRATCH_COLS
    top, _ = _threshold_top(scratch_ptr, topk, True)
    for c in range(lo, hi, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        key, ok = _load_keys(row_ptr, cols, cols < hi)
        _append(sel_ptr + row * K_PAD, scratch_ptr + SELECTED_COUNT, cols, ok & ((key >> 16) > top))
        _append(cand_ptr + row * stride_cand, scratch_ptr + CANDIDATE_COUNT, cols, ok & ((key >> 16) == top))


@triton.jit
def _candidates(row_ptr, cand_ptr, i, num_cand):
    """Columns of candidates ``i`` and their 64-bit keys (order key, then ~column: ties to the
    lower column), and which ``i`` exist."""
    inside = i < num_cand
    cols = tl.load(cand_ptr + i, mask=inside, other=0)
    key, ok = _load_keys(row_ptr, cols, inside)
    return cols, _tie_key(key, cols), ok


@triton.jit
def _candidate_pass(row_ptr, cand_ptr, num_cand, prefix, need, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """One radix pass over the candidates: the 8-bit digit at ``SHIFT`` of the need-th largest
    64-bit key among those matching ``prefix`` above it. Returns the extended prefix and how many
    to take at it, and how many match it."""
    hist = tl.zeros([256], tl.int32)
    for c in range(0, num_cand, BLOCK):
        _, wide, ok = _candidates(row_ptr, cand_ptr, c + tl.arange(0, BLOCK), num_cand)
        ok = ok & ((wide >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        hist += tl.histogram(((wide >> SHIFT) & 255).to(tl.int32), 256, mask=ok)
    digit, above, need = _pick_digit(hist, need)
    level = tl.sum(tl.where(tl.arange(0, 256) == digit, hist, 0), 0)
    return prefix | (digit.to(tl.uint64) << SHIFT), need - above, level


@triton.jit
def _finish_kernel(vals_ptr, stride_v, scratch_ptr, topk, sel_ptr, cand_ptr, stride_cand,
                   prefix_pos_ptr, stride_p, prefix_len, pos_base, out_idx_ptr, stride_o, out_val_ptr, stride_ov,
                   PREFIX: tl.constexpr, VALUES: tl.constexpr, SORT: tl.constexpr, K_PAD: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Pass 4, one program per row: the needed candidates join the selected list, which is sorted
    (by position when not SORT) and written as positions (and scores). With PREFIX, columns below ``prefix_len`` hold a
    running top-k whose positions are ``prefix_pos``; later columns are positions ``pos_base + col
    - prefix_len``."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = vals_ptr + row * stride_v
    scratch_ptr += row * SCRATCH_COLS
    sel_ptr += row * K_PAD
    cand_ptr += row * stride_cand
    top, need = _threshold_top(scratch_ptr, topk, True)
    num_sel = tl.load(scratch_ptr + SELECTED_COUNT)
    num_cand = tl.load(scratch_ptr + CANDIDATE_COUNT)
    threshold = top.to(tl.uint64) << 48
    for s in tl.static_range(2):  # the low 16 key bits
        threshold, need, level = _candidate_pass(row_ptr, cand_ptr, num_cand, threshold, need, 40 - 8 * s, BLOCK)
    if need < level:  # ties at the threshold key and not all of them fit: the 32 column bits decide
        for s in tl.static_range(4):
            threshold, need, level = _candidate_pass(row_ptr, cand_ptr, num_cand, threshold, need, 24 - 8 * s,
                                                     BLOCK)
    for c in range(0, num_cand, BLOCK):
        cols, wide, ok = _candidates(row_ptr, cand_ptr, c + tl.arange(0, BLOCK), num_cand)
        take = ok & (wide >= threshold)
        flags = take.to(tl.int32)
        tl.store(sel_ptr + num_sel + tl.cumsum(flags, 0) - flags, cols, mask=take)
        num_sel += tl.sum(flags, 0)
    tl.debug_barrier()  # the list written above is read back by other threads of this program
    i = tl.arange(0, K_PAD)
    chosen = i < num_sel
    cols = tl.load(sel_ptr + i, mask=chosen, other=0)
    if not SORT:  # positions only, ascending (PREFIX and VALUES need the score order)
        # The list's order comes from atomics: sorting the 32-bit positions makes the output, and
        # so the attention's summation order, deterministic at half the cost of the 64-bit key sort.
        ascending = tl.sort(tl.where(chosen, cols, 0x7FFFFFFF), 0)
        tl.store(out_idx_ptr + row * stride_o + i, tl.where(i < num_sel, ascending, -1), mask=i < topk)
        return
    # sort the selected by (key desc, position asc) and write positions (and scores)
    key = tl.where(chosen, _order_key(tl.load(row_ptr + cols, mask=chosen, other=0.0)), 0)
    if PREFIX:
        early = cols < prefix_len
        pos = tl.load(prefix_pos_ptr + row * stride_p + cols, mask=chosen & early, other=0)
        pos = tl.where(early, pos, pos_base + cols - prefix_len)
    else:
        pos = cols
    packed = tl.sort(tl.where(chosen, _tie_key(key, pos), 0), 0, descending=True)
    tl.debug_barrier()  # every thread has read the scores and positions that the stores below overwrite
    keep = i < topk
    low = tl.full([], 0xFFFFFFFF, tl.uint32)
    pos = tl.where(chosen, (low - (packed & low).to(tl.uint32)).to(tl.int32), -1)
    tl.store(out_idx_ptr + row * stride_o + i, pos, mask=keep)
    if VALUES:
        val = tl.where(chosen, _from_order_key((packed >> 32).to(tl.uint32)), float("-inf"))
        tl.store(out_val_ptr + row * stride_ov + i, val, mask=keep)


def _check_topk(topk: int) -> int:
    if topk > MAX_TOPK:
        raise ValueError(f"triton indexer top-k supports topk <= {MAX_TOPK}, got {topk}")
    return triton.next_power_of_2(topk)


def _split_columns(rows: int, width: int, device: torch.device, block: int) -> int:
    """Columns per program of passes 1-3: enough programs for ~16 per SM, a power of two >= block."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    per_row = max(1, 16 * sms // max(1, rows))
    return max(block, triton.next_power_of_2(triton.cdiv(max(1, width), per_row)))


class _Selection:
    """Scratch of one launch group: per-row histograms and counts, selected and candidate lists."""

    def __init__(self, rows: int, width: int, k_pad: int, device: torch.device, split: Optional[int], block: int,
                 num_warps: int):
        self.scratch = torch.empty(rows, SCRATCH_COLS.value, dtype=torch.int32, device=device)
        self.selected = torch.empty(rows, k_pad, dtype=torch.int32, device=device)
        self.candidates = torch.empty(rows, width, dtype=torch.int32, device=device)
        self.split = split or _split_columns(rows, width, device, block)
        self.k_pad, self.block, self.num_warps = k_pad, block, num_warps

    def run(self, vals: torch.Tensor, topk: int, width: int, out: torch.Tensor, *, ranges=None, prefix=None,
            pos_base: int = 0, out_vals: Optional[torch.Tensor] = None, sort: bool = True) -> None:
        """Top-k of each row of ``vals`` (columns [0, width), or ``ranges`` = (starts, ends)) into ``out``;
        ``prefix`` = (positions, length) maps the first ``length`` columns to positions (fused top-k)."""
        rows = vals.shape[0]
        self.scratch[:rows].zero_()
        starts, ends = ranges if ranges is not None else (self.scratch, self.scratch)
        common = (vals, vals.stride(0), starts, ends, 0, width, self.scratch, topk)
        grid = (rows, triton.cdiv(width, self.split))
        knobs = dict(RANGES=ranges is not None, SPLIT=self.split, BLOCK=self.block, num_warps=self.num_warps)
        for second in (False, True):
            _histogram_kernel[grid](*common, SECOND=second, **knobs)
        _collect_kernel[grid](*common, self.selected, self.candidates, self.candidates.stride(0), K_PAD=self.k_pad,
                              **knobs)
        prefix_pos, prefix_len = prefix if prefix is not None else (out, 0)
        out_vals_or_any = vals if out_vals is None else out_vals
        _finish_kernel[(rows,)](
            vals, vals.stride(0), self.scratch, topk, self.selected, self.candidates, self.candidates.stride(0),
            prefix_pos, prefix_pos.stride(0), prefix_len, pos_base, out, out.stride(0),
            out_vals_or_any, out_vals_or_any.stride(0),
            PREFIX=prefix is not None, VALUES=out_vals is not None, SORT=sort or prefix is not None or out_vals is not None,
            K_PAD=self.k_pad, BLOCK=BLOCK, num_warps=8,
        )


def indexer_topk(logits: torch.Tensor, topk: int, starts: Optional[torch.Tensor], ends: Optional[torch.Tensor],
                 sorted: bool = True, *, num_warps: int = 8, split: Optional[int] = None,
                 block: int = BLOCK) -> torch.Tensor:
    """logits: [T, L] fp32, starts/ends: [T] int32 (both None: whole rows) -> [T, topk] int32 columns
    of the topk largest finite scores in [start, end), score descending, ties to the lower column, -1 padded.
    ``split`` (columns per program, a multiple of ``block``) and ``num_warps`` tune passes 1-3."""
    k_pad = _check_topk(topk)
    num_rows, width = logits.shape
    out = torch.empty(num_rows, topk, dtype=torch.int32, device=logits.device)
    if num_rows == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    group = max(1, min(num_rows, SCRATCH_BYTES // (4 * max(1, width))))  # rows per launch
    selection = _Selection(group, width, k_pad, logits.device, split, block, num_warps)
    for r0 in range(0, num_rows, group):
        rows = slice(r0, min(r0 + group, num_rows))
        ranges = None if starts is None else (starts[rows], ends[rows])
        selection.run(logits[rows], topk, width, out[rows], ranges=ranges, sort=sorted)
    return out


def indexer_fused_topk(q_fp8, weights, k_fp8, k_scale, starts, ends, topk: int, chunk: int) -> torch.Tensor:
    """Top-k of the indexer logits (arguments of ``indexer_logits``) without a whole logits row:
    per group of rows, a buffer [rows, topk + chunk] holds the running top-k scores followed by
    one chunk of scores; after each chunk the selection rewrites the running part in place."""
    k_pad = _check_topk(topk)
    num_q, device = q_fp8.shape[0], q_fp8.device
    out = torch.empty(num_q, topk, dtype=torch.int32, device=device)
    q_fp8, weights, k_fp8, k_scale = (t.contiguous() for t in (q_fp8, weights, k_fp8, k_scale))
    width = topk + chunk
    group = max(1, min(num_q, SCRATCH_BYTES // (4 * width)))
    scores = torch.empty(group, width, dtype=torch.float32, device=device)
    selection = _Selection(group, width, k_pad, device, None, BLOCK, 8)
    for r0 in range(0, num_q, group):
        rows = slice(r0, min(r0 + group, num_q))
        n = rows.stop - r0
        best_pos = out[rows]
        best_pos.fill_(-1)
        scores[:n, :topk] = float("-inf")
        for s0 in range(0, k_fp8.shape[0], chunk):
            c = min(chunk, k_fp8.shape[0] - s0)
            ragged_logits_into(scores[:n, topk:topk + c], q_fp8[rows], weights[rows], k_fp8, k_scale,
                               starts[rows], ends[rows], col0=s0)
            selection.run(scores[:n], topk, topk + c, best_pos, prefix=(best_pos, topk), pos_base=s0,
                          out_vals=scores[:n])
    return out
