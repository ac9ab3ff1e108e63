"""DeepSeek-V4 sparse attention (CSA / HCA / sliding-window layers): public functions, checks, dispatch.

Each query attends over the union of two index sets: (a) the entries its indexer picked from the
compressed cache (``indices``, only the first ``topk_length`` count) and (b) an *extra* set, the
sliding window of the last 128 raw tokens (``extra_indices`` into ``extra_kv`` /
``extra_kv_cache``, only the first ``extra_topk_length`` count), as FlashMLA's MODEL1 decode takes
them. Keys and values are one shared 512-wide latent head (K = V: 448 latent + 64 RoPE values);
scores are ``sm_scale * q . k``. An index < 0 or outside its table, or at a position past its
length, is invalid: it contributes nothing and is never dereferenced; duplicates count once per
occurrence. ``attn_sink: [h_q]`` fp32 adds ``exp(sink)`` to each head's softmax denominator only:
out is scaled by ``exp(lse) / (exp(lse) + exp(sink))`` and lse (natural log, over the valid
indices) does not include it. A row with no valid index gets out = 0, lse = +inf.

Backends: ``reference`` (torch, any device) and ``triton`` (bf16 q, any h_q, 64 and 128 heads
tuned; decode splits the top-k over several programs when the batch is small).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.cache.layout_v4 import V4_HEAD_DIM, V4_TOKEN_BYTES
from flashdsa.runtime.checks import check, check_tensor

__all__ = ["sparse_attention_v4_prefill", "sparse_attention_v4_decode"]

FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)  # fp32/fp64: reference only
TRITON_MAX_HEADS = 128


def _triton_supports(dtype: torch.dtype, h_q: int, **_) -> Optional[str]:
    if dtype != torch.bfloat16:
        return f"triton takes bf16 q, got {dtype}"
    if h_q > TRITON_MAX_HEADS:
        return f"triton handles at most {TRITON_MAX_HEADS} query heads, got {h_q}"
    return None


for _op in __all__:
    dispatch.register(_op, "reference", f"flashdsa.runtime.kernels.reference_v4:{_op}")
    dispatch.register(_op, "triton", f"flashdsa.runtime.kernels.triton.sparse_v4:{_op}", supports=_triton_supports)


def _check_scale(sm_scale: object) -> float:
    is_number = isinstance(sm_scale, (int, float)) and not isinstance(sm_scale, bool)
    check(is_number and math.isfinite(sm_scale) and sm_scale > 0,
          f"sm_scale must be a positive finite float, got {sm_scale!r}")
    return float(sm_scale)


def _check_optional(name: str, t: Optional[torch.Tensor], dtype: torch.dtype, shape: list, expected: str,
                    device: torch.device) -> None:
    if t is not None:
        check_tensor(name, t, dtype, shape, expected, device)


def _check_common(q, h_q, lead, indices, topk_length, attn_sink, extra_table, extra_indices, extra_topk_length,
                  length_rows: int, length_name: str) -> None:
    """Checks shared by prefill and decode: index sets ``[*lead, k]``, lengths ``[length_rows]``, sinks."""
    check(q.shape[-1] == V4_HEAD_DIM and h_q > 0, f"q must have h_q > 0 heads of {V4_HEAD_DIM}, got {list(q.shape)}")
    lead_names = ", ".join(f"{n}" for n in lead)
    check_tensor("indices", indices, torch.int32, [*lead, None], f"int32 [{lead_names}, topk]", q.device)
    check(indices.shape[-1] > 0, f"indices must have topk > 0, got {list(indices.shape)}")
    _check_optional("topk_length", topk_length, torch.int32, [length_rows], f"int32 [{length_name}={length_rows}]",
                    q.device)
    _check_optional("attn_sink", attn_sink, torch.float32, [h_q], f"float32 [h_q={h_q}]", q.device)
    check((extra_table is None) == (extra_indices is None),
          "extra_indices and the extra kv must be given together (the sliding window), or neither")
    check(extra_topk_length is None or extra_indices is not None, "extra_topk_length needs extra_indices")
    if extra_indices is not None:
        check_tensor("extra_indices", extra_indices, torch.int32, [*lead, None], f"int32 [{lead_names}, extra_topk]",
                     q.device)
        _check_optional("extra_topk_length", extra_topk_length, torch.int32, [length_rows],
                        f"int32 [{length_name}={length_rows}]", q.device)


def sparse_attention_v4_prefill(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, *,
    topk_length: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
    extra_kv: Optional[torch.Tensor] = None, extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None, backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 sparse attention over bf16 latents (prefill, training forward).

    Args:
        q: ``[s_q, h_q, 512]`` bf16 (fp32/fp64 on the reference backend).
        kv: ``[s_kv, 1, 512]`` q's dtype, e.g. the compressed entries (s_kv may be 0).
        indices: ``[s_q, 1, topk]`` int32 rows of kv; -1 (or any index outside [0, s_kv)) is invalid.
        sm_scale: positive softmax scale.
        topk_length: optional ``[s_q]`` int32: only ``indices[i, 0, :topk_length[i]]`` count.
        attn_sink: optional ``[h_q]`` fp32 sink logits (see the module docstring).
        extra_kv, extra_indices: optional ``[s_extra, 1, 512]`` and ``[s_q, 1, extra_topk]`` int32,
            a second set (the sliding window) with the same rules; extra_topk_length ``[s_q]``.
        backend: force "reference" or "triton"; None picks the fastest that can serve.

    Returns:
        out ``[s_q, h_q, 512]`` q's dtype and lse ``[s_q, h_q]`` fp32.
    """
    check_tensor("q", q, FLOAT_DTYPES, [None, None, V4_HEAD_DIM], "bf16/fp32/fp64 [s_q, h_q, 512]")
    s_q, h_q, _ = q.shape
    check_tensor("kv", kv, q.dtype, [None, 1, V4_HEAD_DIM], f"{q.dtype} [s_kv, 1, 512] like q", q.device)
    _check_optional("extra_kv", extra_kv, q.dtype, [None, 1, V4_HEAD_DIM], f"{q.dtype} [s_extra, 1, 512] like q",
                    q.device)
    _check_common(q, h_q, [s_q, 1], indices, topk_length, attn_sink, extra_kv, extra_indices, extra_topk_length,
                  s_q, "s_q")
    scale = _check_scale(sm_scale)
    impl = dispatch.select("sparse_attention_v4_prefill", q.device, backend, dtype=q.dtype, h_q=h_q)
    return impl(q, kv, indices, scale, topk_length, attn_sink, extra_kv, extra_indices, extra_topk_length)


def sparse_attention_v4_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, *,
    topk_length: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
    extra_kv_cache: Optional[torch.Tensor] = None, extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None, backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 sparse attention over the paged FP8 MODEL1 caches (decode, MTP, prefill from cache).

    Args:
        q: ``[b, s_q, h_q, 512]`` bf16 (fp32 on the reference backend).
        kv_cache: ``[num_blocks, block_size, 1, 584]`` uint8 MODEL1 pool (``cache.layout_v4``),
            e.g. the CSA or HCA compressed entries.
        indices: ``[b, s_q, topk]`` int32 slot ids (``block_id * block_size + offset``); an id < 0
            or >= num_blocks * block_size is invalid.
        sm_scale: positive softmax scale.
        topk_length: optional ``[b]`` int32: only the first ``topk_length[i]`` ids of request i count.
        attn_sink: optional ``[h_q]`` fp32 sink logits.
        extra_kv_cache, extra_indices, extra_topk_length: optional second pool (the sliding window,
            same layout, any block size), its ``[b, s_q, extra_topk]`` slot ids and ``[b]`` lengths.
        backend: force "reference" or "triton"; None picks the fastest that can serve.

    Returns:
        out ``[b, s_q, h_q, 512]`` q's dtype, lse ``[b, h_q, s_q]`` fp32 (FlashMLA's layout).
    """
    check_tensor("q", q, FLOAT_DTYPES, [None, None, None, V4_HEAD_DIM], "bf16/fp32/fp64 [b, s_q, h_q, 512]")
    b, s_q, h_q, _ = q.shape
    pool = f"uint8 [num_blocks, block_size, 1, {V4_TOKEN_BYTES}]"
    check_tensor("kv_cache", kv_cache, torch.uint8, [None, None, 1, V4_TOKEN_BYTES], pool, q.device)
    _check_optional("extra_kv_cache", extra_kv_cache, torch.uint8, [None, None, 1, V4_TOKEN_BYTES], pool, q.device)
    for name, cache in (("kv_cache", kv_cache), ("extra_kv_cache", extra_kv_cache)):
        check(cache is None or cache.shape[0] * cache.shape[1] > 0, f"{name} must hold at least one slot")
    _check_common(q, h_q, [b, s_q], indices, topk_length, attn_sink, extra_kv_cache, extra_indices,
                  extra_topk_length, b, "b")
    scale = _check_scale(sm_scale)
    impl = dispatch.select("sparse_attention_v4_decode", q.device, backend, dtype=q.dtype, h_q=h_q)
    return impl(q, kv_cache, indices, scale, topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length)
