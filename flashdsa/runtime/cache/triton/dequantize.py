"""Whole blocks of the FP8 MLA cache as bf16 key rows, in Triton: one program per (block, 16 tokens).

The sparse prefill reads its keys from these rows through ``sparse_mla_fwd``, whose producer then
copies rows instead of dequantizing them (see ``cache.dequantize_mla_blocks``). Unlisted blocks
(id < 0 or past the pool) give zero rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.runtime.cache.layout import (
    D_QK,
    MLA_NUM_TILES,
    MLA_ROPE_OFFSET,
    MLA_SCALE_OFFSET,
    MLA_TILE,
    MLA_TOKEN_BYTES,
    ROPE_DIM,
)

TOKENS = 16  # tokens a program dequantizes (fewer for smaller blocks)


@triton.jit
def _dequantize_mla_kernel(block_ids_ptr, u8_ptr, f32_ptr, bf16_ptr, out_ptr, num_blocks,
                           BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, TILES: tl.constexpr,
                           TILE: tl.constexpr, ROPE: tl.constexpr, TOKEN_BYTES: tl.constexpr,
                           SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, D_QK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * TOKENS + tl.arange(0, TOKENS)
    block = tl.load(block_ids_ptr + j).to(tl.int64)
    listed = (block >= 0) & (block < num_blocks)
    inside = tokens < BLOCK_SIZE
    read = (inside & listed)[:, None]  # [TOKENS, 1]
    slots = tl.where(listed, block, 0) * BLOCK_SIZE + tokens  # [TOKENS]
    rows = out_ptr + (j * BLOCK_SIZE + tokens)[:, None] * D_QK  # [TOKENS, 1]
    cols = tl.arange(0, TILES)[:, None] * TILE + tl.arange(0, TILE)[None, :]  # [TILES, TILE]
    codes = tl.load(u8_ptr + slots[:, None, None] * TOKEN_BYTES + cols[None, :, :], mask=read[:, :, None], other=0)
    scales = tl.load(f32_ptr + slots[:, None] * (TOKEN_BYTES // 4) + SCALE_OFF // 4 + tl.arange(0, TILES)[None, :],
                     mask=read, other=0.0)  # [TOKENS, TILES]
    latent = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scales[:, :, None]
    tl.store(rows[:, :, None] + cols[None, :, :], latent.to(tl.bfloat16), mask=inside[:, None, None])
    r = tl.arange(0, ROPE)[None, :]
    rope = tl.load(bf16_ptr + slots[:, None] * (TOKEN_BYTES // 2) + ROPE_OFF // 2 + r, mask=read, other=0.0)
    tl.store(rows + TILES * TILE + r, rope, mask=inside[:, None])


def dequantize_mla_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    num_blocks, block_size = kv_cache.shape[:2]
    out = torch.empty(block_ids.shape[0] * block_size, 1, D_QK, dtype=dtype, device=kv_cache.device)
    if out.numel() == 0:
        return out
    flat = kv_cache.view(-1)
    tokens = min(TOKENS, triton.next_power_of_2(block_size))
    _dequantize_mla_kernel[(block_ids.shape[0], triton.cdiv(block_size, tokens))](
        block_ids, flat, flat.view(torch.float32), flat.view(torch.bfloat16), out, num_blocks,
        BLOCK_SIZE=block_size, TOKENS=tokens, TILES=MLA_NUM_TILES, TILE=MLA_TILE, ROPE=ROPE_DIM,
        TOKEN_BYTES=MLA_TOKEN_BYTES, SCALE_OFF=MLA_SCALE_OFFSET, ROPE_OFF=MLA_ROPE_OFFSET, D_QK=D_QK, num_warps=4)
    return out
