"""Indexer top-k in Triton: radix select of a threshold, then a sort of the few selected.

One program per row. Scores map to order-preserving 32-bit keys. Pass 1 histograms the top 8
bits over the row's range; pass 2 writes the columns of every key in a higher bin to the
selected list and, in column order, those in the threshold bin to a candidate list. Three more
8-bit histogram passes over the candidates only (usually a few percent of the row) find the exact
key of the k-th largest; the candidates above it, and as many equal to it as still needed in
column order (ties to the lower position), join the selected list, which is then sorted by
key descending, position ascending, in registers. The row is read twice; nothing sorts it.

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
SCRATCH_BYTES = 256 << 20  # candidate lists (and fused scores) of the rows one launch handles


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
def _keys_at(row_ptr, list_ptr, i, lo, hi, FROM_LIST: tl.constexpr):
    """(columns, order keys, usable) of entries ``i`` in [lo, hi): row columns ``i`` themselves,
    or the columns listed at ``list_ptr[i]``. Usable: in range and a finite score (NaN and
    +-inf are never selected)."""
    inside = (i >= lo) & (i < hi)
    if FROM_LIST:
        cols = tl.load(list_ptr + i, mask=inside, other=0)
    else:
        cols = i
    x = tl.load(row_ptr + cols, mask=inside, other=float("-inf"))
    return cols, _order_key(x), inside & (tl.abs(x) < float("inf"))


@triton.jit
def _radix_pass(row_ptr, list_ptr, lo, hi, prefix, need, SHIFT: tl.constexpr, FROM_LIST: tl.constexpr,
                BLOCK: tl.constexpr):
    """Histogram the 8-bit digit at ``SHIFT`` of the keys whose higher bits equal ``prefix``'s.
    Returns ``prefix`` with the digit of the need-th largest set, how many matched keys lie in
    higher digits, and ``need`` capped at the number matched."""
    TOP: tl.constexpr = SHIFT + 8
    hist = tl.zeros([256], tl.int32)
    for c in range(lo, hi, BLOCK):
        _, key, ok = _keys_at(row_ptr, list_ptr, c + tl.arange(0, BLOCK), lo, hi, FROM_LIST)
        if TOP < 32:
            ok = ok & ((key >> TOP) == (prefix >> TOP))
        hist += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=ok)
    need = tl.minimum(need, tl.sum(hist, 0))
    at_or_above = tl.cumsum(hist, 0, reverse=True)
    bins = tl.arange(0, 256)
    digit = tl.max(tl.where(at_or_above >= need, bins, 0), 0)
    above = tl.sum(tl.where(bins > digit, hist, 0), 0)
    return prefix | (digit.to(tl.uint32) << SHIFT), above, need


@triton.jit
def _append(list_ptr, count, cols, take):
    """Store ``cols[take]`` at ``list_ptr[count:]`` in order; return the new count."""
    flags = take.to(tl.int32)
    tl.store(list_ptr + count + tl.cumsum(flags, 0) - flags, cols, mask=take)
    return count + tl.sum(flags, 0)


@triton.jit
def _topk_kernel(vals_ptr, stride_v, starts_ptr, ends_ptr, col_lo, col_hi, prefix_pos_ptr, stride_p,
                 prefix_len, pos_base, sel_ptr, cand_ptr, stride_cand, out_idx_ptr, stride_o,
                 out_val_ptr, stride_ov, topk,
                 RANGES: tl.constexpr, PREFIX: tl.constexpr, VALUES: tl.constexpr,
                 K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = vals_ptr + row * stride_v
    sel_ptr += row * K_PAD
    cand_ptr += row * stride_cand
    if RANGES:
        lo = tl.load(starts_ptr + row)
        hi = tl.load(ends_ptr + row)
    else:
        lo = col_lo
        hi = col_hi
    # pass 1: the top byte of the threshold; pass 2: split the row into selected and candidates
    threshold, above, need = _radix_pass(row_ptr, cand_ptr, lo, hi, tl.full([], 0, tl.uint32), topk, 24,
                                         False, BLOCK)
    need -= above
    num_sel = 0
    num_cand = 0
    for c in range(lo, hi, BLOCK):
        cols, key, ok = _keys_at(row_ptr, cand_ptr, c + tl.arange(0, BLOCK), lo, hi, False)
        num_sel = _append(sel_ptr, num_sel, cols, ok & ((key >> 24) > (threshold >> 24)))
        num_cand = _append(cand_ptr, num_cand, cols, ok & ((key >> 24) == (threshold >> 24)))
    tl.debug_barrier()  # the lists written above are read back by other threads of this program
    # the other three bytes of the threshold, over the candidates only
    threshold, above, need = _radix_pass(row_ptr, cand_ptr, 0, num_cand, threshold, need, 16, True, BLOCK)
    need -= above
    threshold, above, need = _radix_pass(row_ptr, cand_ptr, 0, num_cand, threshold, need, 8, True, BLOCK)
    need -= above
    threshold, above, need = _radix_pass(row_ptr, cand_ptr, 0, num_cand, threshold, need, 0, True, BLOCK)
    need -= above
    # candidates above the threshold, and the first `need` equal to it (in column order)
    taken_eq = 0
    for c in range(0, num_cand, BLOCK):
        cols, key, ok = _keys_at(row_ptr, cand_ptr, c + tl.arange(0, BLOCK), 0, num_cand, True)
        eq = ok & (key == threshold)
        eq_rank = taken_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        num_sel = _append(sel_ptr, num_sel, cols, (ok & (key > threshold)) | (eq & (eq_rank < need)))
        taken_eq += tl.sum(eq.to(tl.int32), 0)
    tl.debug_barrier()
    # sort the selected by (key desc, position asc) and write positions (and scores)
    i = tl.arange(0, K_PAD)
    chosen = i < num_sel
    cols = tl.load(sel_ptr + i, mask=chosen, other=0)
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
    tl.debug_barrier()  # every thread has read the scores and positions that the stores below overwrite
    keep = i < topk
    pos = tl.where(chosen, (low - (packed & low).to(tl.uint32)).to(tl.int32), -1)
    tl.store(out_idx_ptr + row * stride_o + i, pos, mask=keep)
    if VALUES:
        val = tl.where(chosen, _from_order_key((packed >> 32).to(tl.uint32)), float("-inf"))
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
    group = max(1, min(num_rows, SCRATCH_BYTES // (4 * max(1, logits.shape[1]))))  # rows per launch
    selected = torch.empty(group, k_pad, dtype=torch.int32, device=logits.device)
    candidates = torch.empty(group, logits.shape[1], dtype=torch.int32, device=logits.device)
    for r0 in range(0, num_rows, group):
        rows = slice(r0, min(r0 + group, num_rows))
        _topk_kernel[(rows.stop - r0,)](
            logits[rows], logits.stride(0), starts[rows], ends[rows], 0, 0, out, 0, 0, 0, selected, candidates,
            candidates.stride(0), out[rows], out.stride(0), logits, 0, topk,
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
    group = max(1, min(num_q, SCRATCH_BYTES // (4 * width)))
    scores = torch.empty(group, width, dtype=torch.float32, device=device)
    selected = torch.empty(group, k_pad, dtype=torch.int32, device=device)
    candidates = torch.empty(group, width, dtype=torch.int32, device=device)
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
                selected, candidates, candidates.stride(0), best_pos, best_pos.stride(0), scores, scores.stride(0),
                topk,
                RANGES=False, PREFIX=True, VALUES=True, K_PAD=k_pad, BLOCK=BLOCK, num_warps=8,
            )
    return out
