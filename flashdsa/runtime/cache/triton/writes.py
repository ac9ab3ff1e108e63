"""Cache writes in Triton: quantize each token and scatter it to its slot (one program a token).

``write_mla_cache`` packs the 656-byte MLA token (4 e4m3 tiles with ``amax / 448`` scales, then
the bf16 RoPE part); ``write_indexer_cache`` rotates the key with the reference's Hadamard
butterfly, quantizes it with a power-of-two scale and writes it into the per-block layout.
Divisions are IEEE round-to-nearest (``div_rn``) and the e4m3 cast rounds to nearest even like
torch, so on a GPU the bytes equal the reference's. Slots outside the pool are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.cache.layout import (
    INDEX_HEAD_DIM,
    MLA_NUM_TILES,
    MLA_ROPE_OFFSET,
    MLA_SCALE_OFFSET,
    MLA_TILE,
    MLA_TOKEN_BYTES,
    ROPE_DIM,
)
from flashdsa.runtime.fp8 import AMAX_FLOOR, E4M3_MAX
from flashdsa.runtime.indexer.triton.hadamard import rotate_rows


@triton.jit
def _to_e4m3_bytes(x, scale):
    """``x / scale`` clamped to +-448 and rounded to the nearest e4m3 (ties to even), as uint8."""
    return _round_to_e4m3_bytes(tl.math.div_rn(x, scale))


@triton.jit
def _round_to_e4m3_bytes(q):
    """fp32 ``q`` (already divided by its scale) clamped to +-448 and rounded to the nearest e4m3
    (ties to even), as uint8.

    Done with integer arithmetic on the fp32 bits, not ``.to(tl.float8e4nv)``: on SM90 Triton's
    cast rounds twice (via fp16), which differs from torch's cast in about 1 byte in 400."""
    q = tl.clamp(q, -448.0, 448.0)
    bits = q.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # normal (>= 2^-6): drop 20 of the 23 mantissa bits with round-half-even, rebias 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal: the nearest multiple of 2^-9, via the 2^23 rounding trick (fp32 add rounds to even)
    sub = (tl.abs(q) * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag >= 0x3C800000, normal, sub) | ((bits >> 24) & 0x80)
    return code.to(tl.uint8)


@triton.jit
def _write_mla_kernel(c_kv_ptr, k_pe_ptr, slot_ptr, u8_ptr, f32_ptr, bf16_ptr, num_slots,
                      stride_c, stride_pe, amax_floor, e4m3_max,
                      TILES: tl.constexpr, TILE: tl.constexpr, ROPE: tl.constexpr,
                      TOKEN_BYTES: tl.constexpr, SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if (slot >= 0) & (slot < num_slots):
        offs = tl.arange(0, TILES)[:, None] * TILE + tl.arange(0, TILE)[None, :]
        x = tl.load(c_kv_ptr + t * stride_c + offs).to(tl.float32)  # [TILES, TILE]
        amax = tl.maximum(tl.max(tl.abs(x), 1), amax_floor)
        scale = tl.math.div_rn(amax, e4m3_max)
        tl.store(u8_ptr + slot * TOKEN_BYTES + offs, _to_e4m3_bytes(x, scale[:, None]))
        tl.store(f32_ptr + slot * (TOKEN_BYTES // 4) + SCALE_OFF // 4 + tl.arange(0, TILES), scale)
        r = tl.arange(0, ROPE)
        k_pe = tl.load(k_pe_ptr + t * stride_pe + r)
        tl.store(bf16_ptr + slot * (TOKEN_BYTES // 2) + ROPE_OFF // 2 + r, k_pe.to(tl.bfloat16))


@triton.jit
def _pow2_ceil(x):
    """``2^ceil(log2(x))`` for positive normal fp32 ``x``, exactly, from its bits."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def rotate_quantize_rows(x, ROWS: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr, rotate_scale, amax_floor,
                         e4m3_max):
    """Rows of ``x: [ROWS, D]`` Hadamard-rotated and rounded to x's dtype (as the reference
    rotates), then e4m3 with one power-of-two scale per row: (uint8 codes [ROWS, D], scales [ROWS])."""
    y = rotate_rows(x.to(tl.float32), ROWS, D, LOG_D) * rotate_scale
    y = y.to(x.dtype).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(y), 1), amax_floor)
    scale = _pow2_ceil(tl.math.div_rn(amax, e4m3_max))
    return _to_e4m3_bytes(y, scale[:, None]), scale


@triton.jit
def _write_indexer_kernel(k_ptr, slot_ptr, u8_ptr, f32_ptr, num_slots, block_size, stride_k,
                          rotate_scale, amax_floor, e4m3_max,
                          D: tl.constexpr, LOG_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if (slot >= 0) & (slot < num_slots):
        d = tl.arange(0, D)
        k = tl.load(k_ptr + t * stride_k + d[None, :])  # [1, D]
        codes, scale = rotate_quantize_rows(k, 1, D, LOG_D, rotate_scale, amax_floor, e4m3_max)
        block = slot // block_size
        offset = slot % block_size
        block_bytes = block_size * (D + 4)
        tl.store(u8_ptr + block * block_bytes + offset * D + d[None, :], codes)
        tl.store(f32_ptr + (block * block_bytes + block_size * D) // 4 + offset + tl.arange(0, 1), scale)


def write_mla_cache(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """c_kv: [T, 512], k_pe: [T, 64] (float), kv_cache: [nb, bs, 1, 656] uint8 (written in
    place), slot_mapping: [T] int64; slots < 0 or past the pool are skipped."""
    num_tokens = c_kv.shape[0]
    if num_tokens == 0:
        return
    c_kv = c_kv if c_kv.stride(-1) == 1 else c_kv.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    _write_mla_kernel[(num_tokens,)](
        c_kv, k_pe, slot_mapping.contiguous(), kv_cache, kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16),
        kv_cache.shape[0] * kv_cache.shape[1], c_kv.stride(0), k_pe.stride(0), AMAX_FLOOR, E4M3_MAX,
        TILES=MLA_NUM_TILES, TILE=MLA_TILE, ROPE=ROPE_DIM, TOKEN_BYTES=MLA_TOKEN_BYTES,
        SCALE_OFF=MLA_SCALE_OFFSET, ROPE_OFF=MLA_ROPE_OFFSET, num_warps=4,
    )


def write_indexer_cache(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k: [T, 128] (float, unrotated), k_cache: [nb, bs, 1, 132] uint8 (written in place),
    slot_mapping: [T] int64; slots < 0 or past the pool are skipped."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    _write_indexer_kernel[(num_tokens,)](
        k, slot_mapping.contiguous(), k_cache, k_cache.view(torch.float32), k_cache.shape[0] * k_cache.shape[1],
        k_cache.shape[1], k.stride(0), INDEX_HEAD_DIM**-0.5, AMAX_FLOOR, E4M3_MAX,
        D=INDEX_HEAD_DIM, LOG_D=INDEX_HEAD_DIM.bit_length() - 1, num_warps=1,
    )
