"""Sparse MLA attention (DeepSeek Sparse Attention): public functions, input checks, dispatch.

Each query attends only to the ``topk`` key/value rows its indices name. Keys and values share
one latent head: a kv row is ``[d_qk]`` wide (512 latent + 64 RoPE in DeepSeek-V3.2) and its
first ``d_v`` columns are the value. Scores are ``sm_scale * q . k`` and ``lse`` is their
natural-log sum-exp over the valid indices. An index < 0 or >= the number of kv rows is
*invalid*: it contributes nothing and is never dereferenced. Duplicate indices count once per
occurrence. A query row with no valid index gets out = 0, lse = +inf, max_logits = -inf.

Backends (see ``flashdsa.runtime.dispatch``): ``reference`` (torch, any device, any shape),
``triton`` (bf16, d_qk 512 or 576, d_v 512, h_q <= 128, topk up to 8192: for the forward and
backward a multiple of 64), ``cuda`` (decode and forward, SM90: bf16, h_q 64 or 128, d_qk 576 (512
too for the forward), d_v 512, any topk up to 16384; measured faster than ``triton`` at every
benchmark shape, so automatic selection picks it for decode, the model's prefill over the FP8
cache and the forward; and the backward, for topk a multiple of 64: native dq and dkv kernels,
1.6x Triton's at the benchmark shape).

DeepSeek-V4's sparse attention (sinks, a sliding-window index set, per-query lengths, the FP8
MODEL1 cache) lives in ``kernels.v4`` and is re-exported here.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from flashdsa.runtime import dispatch, native
from flashdsa.runtime.cache.layout import D_QK, MLA_TOKEN_BYTES
from flashdsa.runtime.checks import check, check_tensor

from flashdsa.runtime.kernels.v4 import sparse_attention_v4_decode, sparse_attention_v4_prefill

__all__ = ["sparse_mla_fwd", "sparse_mla_bwd", "sparse_mla_decode", "sparse_attention_v4_prefill",
           "sparse_attention_v4_decode"]

FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)  # fp32/fp64: reference only
TRITON_D_QK = (512, 576)
TRITON_D_V = 512
TRITON_MAX_TOPK = 8192
TRITON_TOPK_MULTIPLE = 64
TRITON_MAX_HEADS = 128
CUDA_HEADS = (64, 128)  # 64 heads per CTA (cuda/sparse_attention.h)
CUDA_MAX_TOPK = 16384
CUDA_BWD_TOPK_MULTIPLE = 64  # the native dkv's tiles (cuda/sparse_bwd.h)


def _triton_supports(dtype: torch.dtype, h_q: int, d_qk: int, d_v: int, topk: int, topk_multiple: int = 1,
                     **_) -> Optional[str]:
    """Why the Triton kernels cannot serve these shapes, or None when they can."""
    if dtype != torch.bfloat16:
        return f"triton takes bf16 inputs, got {dtype}"
    if d_qk not in TRITON_D_QK or d_v != TRITON_D_V:
        return f"triton needs d_qk in {TRITON_D_QK} and d_v == {TRITON_D_V}, got d_qk={d_qk}, d_v={d_v}"
    if topk % topk_multiple or topk > TRITON_MAX_TOPK:
        return f"triton needs topk a multiple of {topk_multiple} up to {TRITON_MAX_TOPK}, got {topk}"
    if h_q > TRITON_MAX_HEADS:
        return f"triton handles at most {TRITON_MAX_HEADS} query heads, got {h_q}"
    return None


def _cuda_supports(dtype: torch.dtype, h_q: int, d_qk: int, d_v: int, topk: int, **_) -> Optional[str]:
    """Why the native kernels cannot serve these shapes, or None when they can (they are the faster
    choice). The decode's d_qk is always the cache's 576; the forward takes 512 too."""
    if dtype != torch.bfloat16:
        return f"cuda sparse attention takes bf16 queries, got {dtype}"
    if h_q not in CUDA_HEADS or d_qk not in TRITON_D_QK or d_v != TRITON_D_V or topk > CUDA_MAX_TOPK:
        return (f"cuda sparse attention needs h_q in {CUDA_HEADS}, d_qk in {TRITON_D_QK}, d_v == {TRITON_D_V} and "
                f"topk <= {CUDA_MAX_TOPK}, got h_q={h_q}, d_qk={d_qk}, d_v={d_v}, topk={topk}")
    return native.unavailable()


for _op, _module in (("sparse_mla_fwd", "sparse_fwd"), ("sparse_mla_bwd", "sparse_bwd")):
    dispatch.register(_op, "reference", f"{__name__}.reference:{_op}")
    dispatch.register(_op, "triton", f"{__name__}.triton.{_module}:{_op}",
                      supports=functools.partial(_triton_supports, topk_multiple=TRITON_TOPK_MULTIPLE))
dispatch.register("sparse_mla_decode", "reference", f"{__name__}.reference:sparse_mla_decode")
dispatch.register("sparse_mla_decode", "triton", f"{__name__}.triton.sparse_decode:sparse_mla_decode",
                  supports=_triton_supports)  # decode masks the last step: any topk
dispatch.register("sparse_mla_decode", "cuda", f"{__name__}.cuda.sparse_decode:sparse_mla_decode",
                  supports=_cuda_supports)
dispatch.register("sparse_mla_fwd", "cuda", f"{__name__}.cuda.sparse_fwd:sparse_mla_fwd", supports=_cuda_supports)


def _cuda_bwd_supports(topk: int, **facts) -> Optional[str]:
    """The native backward: the native kernels' shapes, topk a whole number of the dkv's 64-slot tiles."""
    if topk % CUDA_BWD_TOPK_MULTIPLE:
        return f"cuda sparse_mla_bwd needs topk a multiple of {CUDA_BWD_TOPK_MULTIPLE}, got {topk}"
    return _cuda_supports(topk=topk, **facts)


dispatch.register("sparse_mla_bwd", "cuda", f"{__name__}.cuda.sparse_bwd:sparse_mla_bwd", supports=_cuda_bwd_supports)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_scalars(sm_scale: object, d_v: object, d_qk: int) -> float:
    """Check ``sm_scale`` (positive finite number) and ``d_v`` (int in [1, d_qk]); return the scale."""
    is_number = isinstance(sm_scale, (int, float)) and not isinstance(sm_scale, bool)
    check(is_number and math.isfinite(sm_scale) and sm_scale > 0,
          f"sm_scale must be a positive finite float, got {sm_scale!r}")
    check(isinstance(d_v, int) and not isinstance(d_v, bool) and 0 < d_v <= d_qk,
          f"d_v must be an int in [1, d_qk={d_qk}], got {d_v!r}")
    return float(sm_scale)


def _check_q(q: object, shape_names: str) -> None:
    """``q`` must be a float tensor with the named dims, none of them empty except the leading ones."""
    names = shape_names.split(", ")
    check_tensor("q", q, FLOAT_DTYPES, [None] * len(names), f"bf16/fp32/fp64 [{shape_names}]")
    check(q.shape[-1] > 0 and q.shape[-2] > 0, f"q must have h_q > 0 and d_qk > 0, got {list(q.shape)}")


def _check_kv_and_indices(q, kv, indices) -> tuple[int, int, int, int]:
    """Check fwd/bwd's kv and indices against ``q: [s_q, h_q, d_qk]``; return (s_q, h_q, d_qk, topk)."""
    _check_q(q, "s_q, h_q, d_qk")
    s_q, h_q, d_qk = q.shape
    check_tensor("kv", kv, q.dtype, [None, 1, d_qk], f"{_name(q.dtype)} [s_kv, 1, d_qk={d_qk}] like q", q.device)
    check_tensor("indices", indices, torch.int32, [s_q, 1, None], f"int32 [s_q={s_q}, 1, topk]", q.device)
    check(indices.shape[-1] > 0, f"indices must have topk > 0, got {list(indices.shape)}")
    return s_q, h_q, d_qk, indices.shape[-1]


def sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
    *, backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA attention forward (prefill / training).

    Args:
        q: ``[s_q, h_q, d_qk]`` bf16 (fp32/fp64 on the reference backend): queries.
        kv: ``[s_kv, 1, d_qk]``, q's dtype: one shared key row per token; its first ``d_v``
            columns are the value. ``s_kv`` may be 0 (every index is then invalid).
        indices: ``[s_q, 1, topk]`` int32: the kv rows each query attends to. An index < 0 or
            >= s_kv is invalid (masked, never read); duplicates count once per occurrence.
        sm_scale: positive softmax scale applied to ``q . k``.
        d_v: value width, 1 <= d_v <= d_qk (512 in DeepSeek-V3.2).
        backend: force "reference", "triton" or "cuda"; None picks the fastest that can serve.

    Returns:
        out: ``[s_q, h_q, d_v]`` in q's dtype, ``sum_i softmax(s)_i * kv[indices_i, :d_v]``.
        max_logits: ``[s_q, h_q]`` fp32, the largest scaled score over valid indices.
        lse: ``[s_q, h_q]`` fp32, natural-log ``logsumexp`` of the scaled scores over valid indices.
        A row with no valid index gets out = 0, max_logits = -inf, lse = +inf.
    """
    _, h_q, d_qk, topk = _check_kv_and_indices(q, kv, indices)
    scale = _check_scalars(sm_scale, d_v, d_qk)
    impl = dispatch.select("sparse_mla_fwd", q.device, backend, dtype=q.dtype, h_q=h_q, d_qk=d_qk, d_v=d_v, topk=topk)
    return impl(q, kv, indices, scale, d_v)


def sparse_mla_bwd(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    indices: torch.Tensor, sm_scale: float, d_v: int = 512, *, deterministic: bool = False,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`sparse_mla_fwd`'s ``out`` with respect to ``q`` and ``kv``.

    Args:
        q, kv, indices, sm_scale, d_v: exactly as given to :func:`sparse_mla_fwd`.
        out: ``[s_q, h_q, d_v]`` q's dtype, the forward output.
        dout: ``[s_q, h_q, d_v]`` q's dtype, the gradient of the loss w.r.t. ``out``.
        lse: ``[s_q, h_q]`` fp32, the forward's lse (+inf on rows with no valid index).
        deterministic: ask for a bitwise-reproducible dkv accumulation (backends that reduce
            with atomics otherwise may differ run to run in the last bits).
        backend: force "reference", "triton" or "cuda"; None picks the fastest that can serve.

    Returns:
        dq: ``[s_q, h_q, d_qk]`` and dkv: ``[s_kv, 1, d_qk]`` in q's dtype (fp32 accumulation).
        dkv sums over every query that selected a row (duplicates count each time): the full
        d_qk as key, plus the first d_v columns as value. Invalid indices add nothing.
    """
    s_q, h_q, d_qk, topk = _check_kv_and_indices(q, kv, indices)
    scale = _check_scalars(sm_scale, d_v, d_qk)
    for name, t in (("out", out), ("dout", dout)):
        check_tensor(name, t, q.dtype, [s_q, h_q, d_v], f"{_name(q.dtype)} [s_q={s_q}, h_q={h_q}, d_v={d_v}]", q.device)
    check_tensor("lse", lse, torch.float32, [s_q, h_q], f"float32 [s_q={s_q}, h_q={h_q}]", q.device)
    check(isinstance(deterministic, bool), f"deterministic must be a bool, got {deterministic!r}")
    impl = dispatch.select("sparse_mla_bwd", q.device, backend, dtype=q.dtype, h_q=h_q, d_qk=d_qk, d_v=d_v, topk=topk)
    return impl(q, kv, out, dout, lse, indices, scale, d_v, deterministic)


def sparse_mla_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
    *, backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention over the paged FP8 cache (decode, MTP, chunked prefill from cache).

    Args:
        q: ``[b, s_q, h_q, 576]`` bf16 (fp32 on the reference backend): absorbed queries.
        kv_cache: ``[num_blocks, block_size, 1, 656]`` uint8, the FP8 MLA pool: per token 512
            e4m3 latents, 4 fp32 tile scales and 64 bf16 RoPE values (``cache.layout``).
        indices: ``[b, s_q, topk]`` int32 slot ids (``block_id * block_size + offset``, so no
            block table is needed). An id < 0 (-1 pads) or >= num_blocks * block_size is invalid:
            masked and never read. Duplicates count once per occurrence.
        sm_scale: positive softmax scale applied to ``q . k``.
        d_v: value width, 1 <= d_v <= 576 (512 in DeepSeek-V3.2).
        backend: force "reference", "triton" or "cuda"; None picks the fastest that can serve.

    Returns:
        out: ``[b, s_q, h_q, d_v]`` in q's dtype, attention over the dequantized selected tokens.
        lse: ``[b, h_q, s_q]`` fp32 natural-log sum-exp of the scaled scores (FlashMLA's layout).
        A row with no valid index gets out = 0 and lse = +inf.
    """
    _check_q(q, "b, s_q, h_q, d_qk=576")
    b, s_q, h_q, d_qk = q.shape
    check(d_qk == D_QK, f"q must have d_qk = {D_QK} (the cache's key width), got {list(q.shape)}")
    check_tensor("kv_cache", kv_cache, torch.uint8, [None, None, 1, MLA_TOKEN_BYTES],
                 f"uint8 [num_blocks, block_size, 1, {MLA_TOKEN_BYTES}]", q.device)
    check_tensor("indices", indices, torch.int32, [b, s_q, None], f"int32 [b={b}, s_q={s_q}, topk]", q.device)
    check(indices.shape[-1] > 0, f"indices must have topk > 0, got {list(indices.shape)}")
    scale = _check_scalars(sm_scale, d_v, d_qk)
    impl = dispatch.select("sparse_mla_decode", q.device, backend, dtype=q.dtype, h_q=h_q, d_qk=d_qk, d_v=d_v,
                           topk=indices.shape[-1])
    return impl(q, kv_cache, indices, scale, d_v)
