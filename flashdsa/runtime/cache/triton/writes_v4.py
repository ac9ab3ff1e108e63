"""DeepSeek-V4 cache write in Triton: quantize each K=V row to FlashMLA's MODEL1 bytes and store
it at its slot (one program a token).

The row is read as 8 tiles of 64: tiles 0-6 (the latent) become e4m3 with a power-of-two scale
each, written as its UE8M0 exponent byte; tile 7 (the RoPE part) is stored as bf16. The e4m3
rounding and the scale are the V3.2 writes' (bit-exact integer code), so on a GPU the bytes equal
the reference's. Slots outside the pool are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.cache.layout_v4 import V4_DATA_BYTES, V4_NUM_TILES, V4_SCALE_BYTES, V4_TILE
from flashdsa.runtime.cache.triton.writes import _pow2_ceil, _to_e4m3_bytes
from flashdsa.runtime.fp8 import AMAX_FLOOR, E4M3_MAX


@triton.jit
def _write_v4_kernel(kv_ptr, slot_ptr, u8_ptr, bf16_ptr, num_slots, block_size, stride_kv, amax_floor, e4m3_max,
                     TILES: tl.constexpr, TILE: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if (slot >= 0) & (slot < num_slots):
        tile = tl.arange(0, TILES + 1)
        col = tl.arange(0, TILE)
        is_latent = tile < TILES
        x = tl.load(kv_ptr + t * stride_kv + tile[:, None] * TILE + col[None, :]).to(tl.float32)  # [8, 64]
        amax = tl.maximum(tl.max(tl.abs(x), 1), amax_floor)
        scale = _pow2_ceil(tl.math.div_rn(amax, e4m3_max))  # [8]
        block = slot // block_size
        block_base = block * block_size * (DATA_BYTES + SCALE_BYTES)
        token_base = block_base + (slot % block_size) * DATA_BYTES
        latent_at = u8_ptr + token_base + tile[:, None] * TILE + col[None, :]
        tl.store(latent_at, _to_e4m3_bytes(x, scale[:, None]), mask=is_latent[:, None])
        rope_at = bf16_ptr + (token_base + TILES * TILE) // 2 + (tile[:, None] - TILES) * TILE + col[None, :]
        tl.store(rope_at, x.to(tl.bfloat16), mask=(tile == TILES)[:, None])
        exponent = tl.where(is_latent, (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF, 0)  # pad byte 0
        scale_at = u8_ptr + block_base + block_size * DATA_BYTES + (slot % block_size) * SCALE_BYTES + tile
        tl.store(scale_at, exponent.to(tl.uint8))


def write_v4_cache(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv: [T, 512] float, kv_cache: [nb, bs, 1, 584] uint8 (written in place), slot_mapping: [T]
    int64; slots < 0 or past the pool are skipped."""
    num_tokens = kv.shape[0]
    if num_tokens == 0:
        return
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    _write_v4_kernel[(num_tokens,)](
        kv, slot_mapping.contiguous(), kv_cache, kv_cache.view(torch.bfloat16), kv_cache.shape[0] * kv_cache.shape[1],
        kv_cache.shape[1], kv.stride(0), AMAX_FLOOR, E4M3_MAX,
        TILES=V4_NUM_TILES, TILE=V4_TILE, DATA_BYTES=V4_DATA_BYTES, SCALE_BYTES=V4_SCALE_BYTES, num_warps=2,
    )
