"""Byte layout of the DeepSeek-V4 latent cache: FlashMLA's "MODEL1" FP8 format, 584 B/token.

One shared K = V head of 512 per token: 448 latent ("NoPE") values quantized to e4m3 in 7 tiles of
64, each with a UE8M0 scale (a power of two stored as its biased exponent byte, 2^(byte - 127)),
and 64 RoPE values kept in bf16. As FlashMLA's sparse decode reads it (``csrc/sm90/decode/
sparse_fp8/splitkv_mla.cuh``), a pool ``[num_blocks, block_size, 1, 584]`` uint8 is laid out per
*block*, not per token:

  bytes [0, block_size * 576)                  token-major: 448 e4m3 latents, then 64 bf16 RoPE
  bytes [block_size * 576, block_size * 584)   token-major: 7 UE8M0 scale bytes, then 1 pad byte (0)

The key is ``[dequantized latent (448) | RoPE (64)]`` and the value is the same 512 values.
Scales are ``2^ceil(log2(amax / 448))`` per tile (amax clamped at ``fp8.AMAX_FLOOR``), as
DeepSeek's ``ue8m0`` quantization, so dequantization multiplies exactly.

Bytes per token of context a V4 layer keeps (``v4_bytes_per_token``): a sliding-window layer
only its last 128 tokens; a CSA layer one 584-byte entry per 4 tokens plus one 132-byte FP8
indexer key (the V3.2 indexer layout, ``layout.INDEXER_TOKEN_BYTES``) per entry; an HCA layer
one entry per 128 tokens.
"""

from __future__ import annotations

import torch

from flashdsa.runtime.cache.layout import INDEXER_TOKEN_BYTES
from flashdsa.runtime.fp8 import E4M3, quantize_e4m3

V4_HEAD_DIM = 512  # d_qk = d_v
V4_ROPE_DIM = 64
V4_NOPE_DIM = V4_HEAD_DIM - V4_ROPE_DIM  # 448
V4_TILE = 64
V4_NUM_TILES = V4_NOPE_DIM // V4_TILE  # 7
V4_DATA_BYTES = V4_NOPE_DIM + 2 * V4_ROPE_DIM  # 576: latent e4m3 + RoPE bf16
V4_SCALE_BYTES = V4_NUM_TILES + 1  # 8: 7 UE8M0 scales + 1 pad byte
V4_TOKEN_BYTES = V4_DATA_BYTES + V4_SCALE_BYTES  # 584
UE8M0_BIAS = 127
V4_SLIDING_WINDOW = 128
V4_CSA_RATIO = 4
V4_HCA_RATIO = 128


def v4_bytes_per_token(layer_type: str) -> float:
    """Cache bytes per token of context, asymptotically, for ``layer_type`` "sliding" (0: a fixed
    128-token window), "csa" (584/4 latent + 132/4 indexer key = 179) or "hca" (584/128)."""
    per_layer = {"sliding": 0.0, "csa": (V4_TOKEN_BYTES + INDEXER_TOKEN_BYTES) / V4_CSA_RATIO,
                 "hca": V4_TOKEN_BYTES / V4_HCA_RATIO}
    if layer_type not in per_layer:
        raise ValueError(f"layer_type must be one of {sorted(per_layer)}, got {layer_type!r}")
    return per_layer[layer_type]


def quantize_v4(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv: [..., 512]`` -> (data ``[..., 576]`` uint8: e4m3 latents then bf16 RoPE,
    scales ``[..., 8]`` uint8: 7 UE8M0 exponent bytes and a 0 pad byte)."""
    if kv.shape[-1] != V4_HEAD_DIM:
        raise ValueError(f"kv must be [..., {V4_HEAD_DIM}], got {list(kv.shape)}")
    latent, scale = quantize_e4m3(kv[..., :V4_NOPE_DIM], V4_TILE, pow2=True)
    data = torch.empty(*kv.shape[:-1], V4_DATA_BYTES, dtype=torch.uint8, device=kv.device)
    data[..., :V4_NOPE_DIM] = latent.view(torch.uint8)
    data[..., V4_NOPE_DIM:] = kv[..., V4_NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(*kv.shape[:-1], V4_SCALE_BYTES, dtype=torch.uint8, device=kv.device)
    scales[..., :V4_NUM_TILES] = (torch.log2(scale).round().to(torch.int32) + UE8M0_BIAS).to(torch.uint8)
    return data, scales


def dequantize_v4(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_v4`: data ``[..., 576]`` and scales ``[..., 8]`` uint8 -> fp32 ``[..., 512]``."""
    latent = data[..., :V4_NOPE_DIM].contiguous().view(E4M3).float()
    scale = torch.exp2(scales[..., :V4_NUM_TILES].float() - UE8M0_BIAS)
    latent = (latent.unflatten(-1, (V4_NUM_TILES, V4_TILE)) * scale.unsqueeze(-1)).flatten(-2)
    rope = data[..., V4_NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=-1)


def v4_block_views(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a V4 pool ``[num_blocks, block_size, 1, 584]`` uint8 (contiguous blocks):
    (data ``[num_blocks, block_size, 576]``, scales ``[num_blocks, block_size, 8]``), both uint8."""
    if pool.dtype != torch.uint8 or pool.dim() != 4 or pool.shape[2:] != (1, V4_TOKEN_BYTES):
        raise ValueError(f"V4 cache must be uint8 [num_blocks, block_size, 1, {V4_TOKEN_BYTES}], "
                         f"got {pool.dtype} {list(pool.shape)}")
    num_blocks, block_size = pool.shape[:2]
    flat = pool.view(num_blocks, block_size * V4_TOKEN_BYTES)
    data = flat[:, : block_size * V4_DATA_BYTES].unflatten(1, (block_size, V4_DATA_BYTES))
    scales = flat[:, block_size * V4_DATA_BYTES :].unflatten(1, (block_size, V4_SCALE_BYTES))
    return data, scales


def gather_v4(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Dequantized keys ``[..., 512]`` fp32 of ``slots: [...]`` (int64, each in [0, capacity))."""
    data, scales = v4_block_views(pool)
    block, offset = slots // pool.shape[1], slots % pool.shape[1]
    return dequantize_v4(data[block, offset], scales[block, offset])
