"""Byte layouts of the two paged caches (see DESIGN.md, "Byte layouts").

MLA latent cache, 656 B/token, pool ``[num_blocks, block_size, 1, 656]`` uint8:
  bytes [0, 512)    512 e4m3 values of c_kv, 4 tiles of 128
  bytes [512, 528)  4 fp32 scales, scale_i = amax(tile_i) / 448
  bytes [528, 656)  64 bf16 values of the RoPE'd k_pe, not quantized

Indexer key cache, 132 B/token, pool ``[num_blocks, block_size, 1, 132]`` uint8, laid out per
*block* (DeepGEMM's paged indexer layout), not per token:
  bytes [0, block_size * 128)                      e4m3 keys, token-major, 128 bytes each
  bytes [block_size * 128, block_size * 132)       block_size fp32 power-of-two scales
"""

from __future__ import annotations

import torch

from flashdsa.runtime.fp8 import E4M3, dequantize_e4m3, quantize_e4m3

BLOCK_SIZE = 64

KV_LORA_RANK = 512  # latent width, also d_v
ROPE_DIM = 64
D_QK = KV_LORA_RANK + ROPE_DIM  # 576
MLA_TILE = 128
MLA_NUM_TILES = KV_LORA_RANK // MLA_TILE  # 4
MLA_LATENT_OFFSET = 0
MLA_SCALE_OFFSET = KV_LORA_RANK  # 512
MLA_ROPE_OFFSET = MLA_SCALE_OFFSET + 4 * MLA_NUM_TILES  # 528
MLA_TOKEN_BYTES = MLA_ROPE_OFFSET + 2 * ROPE_DIM  # 656

INDEX_HEAD_DIM = 128
INDEXER_TOKEN_BYTES = INDEX_HEAD_DIM + 4  # 132


def quantize_mla(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Pack ``c_kv: [..., 512]`` and ``k_pe: [..., 64]`` into ``[..., 656]`` uint8 tokens."""
    q, scale = quantize_e4m3(c_kv, MLA_TILE, pow2=False)
    out = torch.empty(*c_kv.shape[:-1], MLA_TOKEN_BYTES, dtype=torch.uint8, device=c_kv.device)
    out[..., MLA_LATENT_OFFSET:MLA_SCALE_OFFSET] = q.view(torch.uint8)
    out[..., MLA_SCALE_OFFSET:MLA_ROPE_OFFSET] = scale.contiguous().view(torch.uint8)
    out[..., MLA_ROPE_OFFSET:] = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def mla_fields(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of ``tokens: [..., 656]`` uint8 (contiguous last dim): (latent e4m3 [..., 512],
    scales fp32 [..., 4], k_pe bf16 [..., 64])."""
    if tokens.dtype != torch.uint8 or tokens.shape[-1] != MLA_TOKEN_BYTES:
        raise ValueError(f"tokens must be uint8 [..., {MLA_TOKEN_BYTES}], got {tokens.dtype} {list(tokens.shape)}")
    latent = tokens[..., MLA_LATENT_OFFSET:MLA_SCALE_OFFSET].view(E4M3)
    scales = tokens[..., MLA_SCALE_OFFSET:MLA_ROPE_OFFSET].view(torch.float32)
    k_pe = tokens[..., MLA_ROPE_OFFSET:].view(torch.bfloat16)
    return latent, scales, k_pe


def dequantize_mla(tokens: torch.Tensor) -> torch.Tensor:
    """Unpack ``[..., 656]`` uint8 tokens to the fp32 ``[..., 576]`` key (latent, then k_pe)."""
    latent, scales, k_pe = mla_fields(tokens)
    return torch.cat([dequantize_e4m3(latent, scales), k_pe.float()], dim=-1)


def quantize_indexer_key(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k: [..., 128]`` (already Hadamard-rotated) -> (e4m3 [..., 128], pow2 scale fp32 [...])."""
    q, scale = quantize_e4m3(k, INDEX_HEAD_DIM, pow2=True)
    return q, scale.squeeze(-1)


def indexer_block_views(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the indexer pool ``[num_blocks, block_size, 1, 132]`` uint8:
    (keys e4m3 [num_blocks, block_size, 128], scales fp32 [num_blocks, block_size])."""
    if pool.dtype != torch.uint8 or pool.dim() != 4 or pool.shape[2:] != (1, INDEXER_TOKEN_BYTES):
        raise ValueError(
            f"indexer cache must be uint8 [num_blocks, block_size, 1, {INDEXER_TOKEN_BYTES}], "
            f"got {pool.dtype} {list(pool.shape)}"
        )
    num_blocks, block_size = pool.shape[:2]
    flat = pool.view(num_blocks, block_size * INDEXER_TOKEN_BYTES)
    keys = flat[:, : block_size * INDEX_HEAD_DIM].view(E4M3).view(num_blocks, block_size, INDEX_HEAD_DIM)
    scales = flat[:, block_size * INDEX_HEAD_DIM :].view(torch.float32)
    return keys, scales
