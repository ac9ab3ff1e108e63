"""RoPE of q and k in one Triton kernel, in place: the angles computed in-kernel from the positions.

Program (t, head block): cos/sin of token t's ``R/2`` angles, then the rotation of its q heads in
the block; the block-0 program rotates k as well. ``tl.cos``/``tl.sin`` lower to libdevice's
``cosf``/``sinf``, the functions torch's CUDA kernels call, and every product and sum is rounded
to the activations' dtype as torch rounds it, so bf16 results equal the torch expression's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_H = 16  # heads per program: 16 x 32 pairs in registers


@triton.jit
def _rotate_pairs(ptr, first, second, cos, sin, mask):
    """Rotate the pairs (ptr[first], ptr[second]) by (cos, sin) in place, rounding like torch."""
    a = tl.load(ptr + first, mask=mask)
    b = tl.load(ptr + second, mask=mask)
    dtype = a.dtype
    a_cos, b_sin = (a.to(tl.float32) * cos).to(dtype), (b.to(tl.float32) * sin).to(dtype)
    b_cos, a_sin = (b.to(tl.float32) * cos).to(dtype), (a.to(tl.float32) * sin).to(dtype)
    tl.store(ptr + first, (a_cos.to(tl.float32) - b_sin.to(tl.float32)).to(dtype), mask=mask)
    tl.store(ptr + second, (b_cos.to(tl.float32) + a_sin.to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, freq_ptr, attention_factor, heads, stride_qt, stride_qh, stride_kt,
                 HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, HAS_K: tl.constexpr,
                 INVERSE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    i = tl.arange(0, HALF)
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + i)
    dtype = q_ptr.dtype.element_ty
    cos = (tl.cos(angle) * attention_factor).to(dtype).to(tl.float32)  # in x's dtype, as torch casts it
    sin = (tl.sin(angle) * attention_factor).to(dtype).to(tl.float32)
    if INVERSE:  # the negated angle: cos as it is, sin negated (exact, as torch's -sin is)
        sin = -sin
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + HALF
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = q_ptr + t * stride_qt + h[:, None].to(tl.int64) * stride_qh
    _rotate_pairs(rows, first[None, :], second[None, :], cos[None, :], sin[None, :], h[:, None] < heads)
    if HAS_K and head_block == 0:
        _rotate_pairs(k_ptr + t * stride_kt, first, second, cos, sin, i < HALF)


def apply_rope_(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor,
                attention_factor: float, interleaved: bool, inverse: bool = False) -> None:
    tokens, heads, _ = q.shape
    if tokens == 0:
        return
    block_h = min(triton.next_power_of_2(heads), MAX_BLOCK_H)
    grid = (tokens, triton.cdiv(heads, block_h))
    k_arg = q if k is None else k  # never read without HAS_K
    _rope_kernel[grid](q, k_arg, positions, inv_freq, float(attention_factor), heads, q.stride(0), q.stride(1),
                       k_arg.stride(0), HALF=inv_freq.shape[0], INTERLEAVED=interleaved, BLOCK_H=block_h,
                       HAS_K=k is not None, INVERSE=inverse, num_warps=2)
