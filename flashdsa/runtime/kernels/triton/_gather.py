"""Pieces shared by the sparse forward and backward kernels.

Both kernels give one program a query token and a block of up to 64 of its heads (the heads are the
M dimension of the matrix products), walk the token's top-k indices ``BLOCK_N`` at a time, and
gather those kv rows with masked loads: an invalid index (< 0 or >= s_kv) is clamped to row 0 and
its load masked, so it is never dereferenced.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
D_NOPE = 512  # latent part of the 576 (or 512) query/key dims; also d_v
NOPE = tl.constexpr(D_NOPE)  # the same, readable inside kernels
MAX_BLOCK_H = 64  # one warpgroup's MMA height; more heads take more programs


def head_blocking(h_q: int) -> tuple[int, int]:
    """(heads per program, programs per token): h_q padded to 16, 32 or 64 heads per program."""
    block_h = min(MAX_BLOCK_H, max(16, triton.next_power_of_2(h_q)))
    return block_h, triton.cdiv(h_q, block_h)


@triton.jit
def gather_kv(kv_ptr, idx_row_ptr, start, s_kv, stride_kv,
              BLOCK_N: tl.constexpr, D_PE: tl.constexpr):
    """Rows ``idx[start:start+BLOCK_N]`` of kv: (valid [N], safe index [N] int64, nope [N, 512], pe [N, D_PE])."""
    idx = tl.load(idx_row_ptr + start + tl.arange(0, BLOCK_N))
    valid = (idx >= 0) & (idx < s_kv)
    row = tl.where(valid, idx, 0).to(tl.int64)
    base = kv_ptr + row[:, None] * stride_kv
    nope = tl.load(base + tl.arange(0, NOPE)[None, :], mask=valid[:, None], other=0.0)
    if D_PE > 0:
        pe = tl.load(base + NOPE + tl.arange(0, D_PE)[None, :], mask=valid[:, None], other=0.0)
    else:
        pe = nope  # unused placeholder when d_qk == 512
    return valid, row, nope, pe


@triton.jit
def load_heads(ptr, heads, head_mask, stride_h, OFFSET: tl.constexpr, WIDTH: tl.constexpr):
    """A [BLOCK_H, WIDTH] tile of a per-token [h, d] matrix at column OFFSET (padded heads read 0)."""
    cols = OFFSET + tl.arange(0, WIDTH)
    return tl.load(ptr + heads[:, None] * stride_h + cols[None, :], mask=head_mask[:, None], other=0.0)


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """``a @ b + acc`` with fp32 accumulation. UPCAST (set under TRITON_INTERPRET=1) feeds the
    interpreter fp32 operands: its bf16 dot multiplies the raw uint16 bit patterns (triton 3.6)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def to_bf16(x, INTERPRET: tl.constexpr):
    """Round fp32 to bf16, to nearest even. The GPU's conversion does that; the interpreter's
    truncates (triton 3.6), so there we round the bits first and the truncation becomes exact."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def softmax_step(s, m, l, acc, v, INTERPRET: tl.constexpr):
    """One online-softmax step over a tile: scores ``s: [H, N]`` (base-2 units, -inf where
    masked), values ``v: [N, D]`` bf16 -> updated (running max m [H], sum l [H], acc [H, D] fp32)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing valid yet
    alpha = tl.math.exp2(m - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = mma(to_bf16(p, INTERPRET), v, acc * alpha[:, None], INTERPRET)
    return m_new, l, acc
