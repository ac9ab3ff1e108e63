"""Indexer top-k in Triton: radix select of a threshold, then a sort of the few selected.

One program per row. Scores map to order-preserving 32-bit keys; three histogram passes (11,
11 and 10 bits) find the exact key of the k-th largest finite score in the row's range; a fourth
pass writes the columns of every score above it and, in column order, of as many equal to it as
are still needed (so ties go to the lower position); the selected (key, position) pairs are then
sorted by key descending, position ascending, in registers. No full sort of the row.

The fused score + top-k walks the keys ``chunk`` at a time: the ragged logits kernel writes a
chunk's scores next to the running top-k (values and positions), and the same top-k kernel
selects from both, so no whole logits row is ever held. Its memory is ``O(rows * (topk + chunk))``
with rows processed in groups that bound it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.indexer.triton.logits import ragged_logits_into

BLOCK = 2048  # scores per step of a pass
MAX_TOPK = 8192  # the selected pairs are sorted in registers
FUSED_BUFFER_BYTES = 256 << 20  # scores + positions of one group of rows in the fused top-k


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
def _load_keys(row_ptr, cols, lo, hi):
    """Order keys of ``row_ptr[cols]`` and which of them are finite scores inside [lo, hi)."""
    inside = (cols >= lo) & (cols < hi)
    x = tl.load(row_ptr + cols, mask=inside, other=float("-inf"))
    ok = inside & (tl.abs(x) < float("inf"))  # NaN and +-inf are never selected
    return _order_key(x), ok


@triton.jit
def _radix_pass(row_ptr, lo, hi, prefix, need, SHIFT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram the digit ``key[SHIFT : SHIFT + BITS]`` of the keys whose higher bits equal
    ``prefix``'s. Returns ``prefix`` with the digit of the need-th largest set, how many matched
    keys lie above that digit, and ``need`` capped at the number matched."""
    BINS: tl.constexpr = 1 << BITS
    TOP: tl.constexpr = SHIFT + BITS
    hist = tl.zeros([BINS], tl.int32)
    for c in range(lo, hi, BLOCK):
        key, ok = _load_keys(row_ptr, c + tl.arange(0, BLOCK), lo, hi)
        if TOP < 32:
            ok = ok & ((key >> TOP) == (prefix >> TOP))
        digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=ok)
    need = tl.minimum(need, tl.sum(hist, 0))
    at_or_above = tl.cumsum(hist, 0, reverse=True)
    bins = tl.arange(0, BINS)
    digit = tl.max(tl.where(at_or_above >= need, bins, 0), 0)
    above = tl.sum(tl.where(bins > digit, hist, 0), 0)
    return prefix | (digit.to(tl.uint32) << SHIFT), above, need


@triton.jit
def _topk_kernel(vals_ptr, stride_v, starts_ptr, ends_ptr, col_lo, col_hi, prefix_pos_ptr, stride_p,
                 prefix_len, pos_base, cols_ptr, out_idx_ptr, stride_o, out_val_ptr, stride_ov, topk,
                 RANGES: tl.constexpr, PREFIX: tl.constexpr, VALUES: tl.constexpr,
                 K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = vals_ptr + row * stride_v
    if RANGES:
        lo = tl.load(starts_ptr + row)
        hi = tl.load(ends_ptr + row)
    else:
        lo = col_lo
        hi = col_hi
    # threshold: the exact key of the k-th largest, digit by digit (bits 31..21, 20..10, 9..0)
    threshold = tl.full([], 0, tl.uint32)
    threshold, above, need = _radix_pass(row_ptr, lo, hi, threshold, topk, 21, 11, BLOCK)
    threshold, above2, need = _radix_pass(row_ptr, lo, hi, threshold, need - above, 10, 11, BLOCK)
    threshold, above, need = _radix_pass(row_ptr, lo, hi, threshold, need - above2, 0, 10, BLOCK)
    need -= above
    # collect: every key above the threshold, and the first `need` equal to it, in column order
    taken = 0
    taken_eq = 0
    for c in range(lo, hi, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        key, ok = _load_keys(row_ptr, cols, lo, hi)
        eq = ok & (key == threshold)
        eq_rank = taken_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        take = (ok & (key > threshold)) | (eq & (eq_rank < need))
        slot = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(cols_ptr + row * K_PAD + slot, cols, mask=take)
        taken += tl.sum(take.to(tl.int32), 0)
        taken_eq += tl.sum(eq.to(tl.int32), 0)
    # sort the selected by (key desc, position asc) and write positions (and scores)
    i = tl.arange(0, K_PAD)
    chosen = i < taken
    cols = tl.load(cols_ptr + row * K_PAD + i, mask=chosen, other=0)
    key = tl.where(chosen, _order_key(tl.load(row_ptr + cols, mask=chosen, other=0.0)), 0)
    if PREFIX:
        early = cols < prefix_len
        pos = tl.load(prefix_pos_ptr + row * stride_p + cols, mask=chosen & early, other=0)
        pos = tl.where(early, pos, pos_base + cols - prefix_len)
    else:
        pos = cols
    low = tl.full([], 0xFFFFFFFF, tl.uint32)
    packed = (key.to(tl.uint64) << 32) | (low - pos.to(tl.uint32)).to(tl.uint64)  # ties: lower position first
    packed = tl.sort(tl.where(chosen, packed, 0), 0, descending=True)
    keep = i < topk
    pos = tl.where(i < taken, (low - (packed & low).to(tl.uint32)).to(tl.int32), -1)
    tl.store(out_idx_ptr + row * stride_o + i, pos, mask=keep)
    if VALUES:
        val = tl.where(i < taken, _from_order_key((packed >> 32).to(tl.uint32)), float("-inf"))
        tl.store(out_val_ptr + row * stride_ov + i, val, mask=keep)


def _check_topk(topk: int) -> int:
    if topk > MAX_TOPK:
        raise ValueError(f"triton indexer top-k supports topk <= {MAX_TOPK}, got {topk}")
    return triton.next_power_of_2(topk)


def indexer_topk(logits: torch.Tensor, topk: int, starts: torch.Tensor, ends: torch.Tensor, *,
                 num_warps: int = 8) -> torch.Tensor:
    """logits: [T, L] fp32, starts/ends: [T] int32 -> [T, topk] int32 columns of the topk
    largest finite scores in [start, end), score descending, ties to the lower column, -1 padded."""
    k_pad = _check_topk(topk)
    num_rows = logits.shape[0]
    out = torch.empty(num_rows, topk, dtype=torch.int32, device=logits.device)
    if num_rows == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    scratch = torch.empty(num_rows, k_pad, dtype=torch.int32, device=logits.device)
    _topk_kernel[(num_rows,)](
        logits, logits.stride(0), starts, ends, 0, 0, out, 0, 0, 0, scratch, out, out.stride(0), logits, 0, topk,
        RANGES=True, PREFIX=False, VALUES=False, K_PAD=k_pad, BLOCK=BLOCK, num_warps=num_warps,
    )
    return out


def indexer_fused_topk(q_fp8, weights, k_fp8, k_scale, starts, ends, topk: int, chunk: int) -> torch.Tensor:
    """Top-k of the indexer logits (arguments of ``indexer_logits``) without a whole logits row:
    per group of rows, a buffer [rows, topk + chunk] holds the running top-k scores followed by
    one chunk of scores; after each chunk the top-k kernel rewrites the running part in place."""
    k_pad = _check_topk(topk)
    num_q, device = q_fp8.shape[0], q_fp8.device
    out = torch.empty(num_q, topk, dtype=torch.int32, device=device)
    q_fp8, weights, k_fp8, k_scale = (t.contiguous() for t in (q_fp8, weights, k_fp8, k_scale))
    width = topk + chunk
    group = max(1, min(num_q, FUSED_BUFFER_BYTES // (4 * width)))
    scores = torch.empty(group, width, dtype=torch.float32, device=device)
    scratch = torch.empty(group, k_pad, dtype=torch.int32, device=device)
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
            _topk_kernel[(n,)](
                scores, scores.stride(0), starts, ends, 0, topk + c, best_pos, best_pos.stride(0), topk, s0,
                scratch, best_pos, best_pos.stride(0), scores, scores.stride(0), topk,
                RANGES=False, PREFIX=True, VALUES=True, K_PAD=k_pad, BLOCK=BLOCK, num_warps=8,
            )
    return out
