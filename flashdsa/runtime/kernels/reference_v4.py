"""Reference (torch) DeepSeek-V4 sparse attention: the ground truth the V4 Triton kernels are
checked against.

The two index sets a query attends over (top-k compressed entries and the sliding window, each
with its own table) are merged into one: an index past its per-query length or outside its table
becomes -1, extra indices are shifted past the main table, and the V3.2 reference's chunked,
masked ``_attend`` (fp32, invalid rows never dereferenced) computes out and lse over the union.
The attention sink then scales out by ``exp(lse) / (exp(lse) + exp(sink))`` (FlashMLA's
definition): the sink joins the softmax denominator only, and lse does not include it.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime.cache.layout_v4 import gather_v4
from flashdsa.runtime.kernels.reference import _attend, _compute_dtype


def _masked(indices: torch.Tensor, lengths: Optional[torch.Tensor], num_rows: int) -> torch.Tensor:
    """``indices: [n, k]`` as int64 with -1 where invalid: outside [0, num_rows) or at a position
    >= ``lengths: [n]`` (None: all k positions count)."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < num_rows)
    if lengths is not None:
        valid &= torch.arange(idx.shape[-1], device=idx.device) < lengths.long()[:, None]
    return torch.where(valid, idx, -1)


def _union(indices, lengths, num_rows, extra_indices, extra_lengths, extra_rows) -> torch.Tensor:
    """Main and extra index sets as one ``[n, k + extra_k]`` list into the main table followed by
    the extra one (-1 = invalid)."""
    main = _masked(indices, lengths, num_rows)
    if extra_indices is None:
        return main
    extra = _masked(extra_indices, extra_lengths, extra_rows)
    return torch.cat([main, torch.where(extra >= 0, extra + num_rows, -1)], dim=-1)


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: Optional[torch.Tensor]) -> torch.Tensor:
    """``out: [n, h, d]`` scaled by ``sigmoid(lse - sink)`` per head; rows without a valid index
    (lse = +inf, out = 0) stay 0 whatever the sink."""
    if attn_sink is None:
        return out
    factor = torch.sigmoid(lse - attn_sink.float())
    return out * torch.where(torch.isinf(lse) & (lse > 0), 0.0, factor).unsqueeze(-1).to(out.dtype)


def _attend_union(q, table, to_keys, rows, sm_scale, attn_sink) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q: [n, h, 512]`` over ``rows: [n, k]`` of ``table``: (out [n, h, 512] q's dtype, lse [n, h])."""
    cdtype = _compute_dtype(q.dtype)
    out, _, lse = _attend(q.to(cdtype), table, to_keys, rows, sm_scale, q.shape[-1], None)
    return _apply_sink(out, lse, attn_sink).to(q.dtype), lse


def sparse_attention_v4_prefill(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
    topk_length: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
    extra_kv: Optional[torch.Tensor] = None, extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[s_q, h_q, 512]``, kv ``[s_kv, 1, 512]``, indices ``[s_q, 1, topk]`` (+ optional extra
    set) -> (out ``[s_q, h_q, 512]``, lse ``[s_q, h_q]`` fp32)."""
    cdtype = _compute_dtype(q.dtype)
    tables = [kv[:, 0]] + ([extra_kv[:, 0]] if extra_kv is not None else [])
    table = torch.cat(tables).to(cdtype)
    extra = extra_indices[:, 0] if extra_indices is not None else None
    extra_rows = extra_kv.shape[0] if extra_kv is not None else 0
    rows = _union(indices[:, 0], topk_length, kv.shape[0], extra, extra_topk_length, extra_rows)
    return _attend_union(q, table, lambda keys: keys, rows, sm_scale, attn_sink)


def sparse_attention_v4_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
    topk_length: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
    extra_kv_cache: Optional[torch.Tensor] = None, extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, s_q, h_q, 512]``, kv_cache ``[nb, bs, 1, 584]`` uint8 (MODEL1), indices ``[b, s_q,
    topk]`` slot ids (+ optional extra cache and slots) -> (out ``[b, s_q, h_q, 512]``, lse
    ``[b, h_q, s_q]`` fp32). Lengths are per batch ``[b]``, as FlashMLA's."""
    b, s_q, h_q, d = q.shape
    cdtype = _compute_dtype(q.dtype)
    main_slots = kv_cache.shape[0] * kv_cache.shape[1]
    extra_slots = extra_kv_cache.shape[0] * extra_kv_cache.shape[1] if extra_kv_cache is not None else 0

    def per_row(lengths: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if lengths is None else lengths.repeat_interleave(s_q)

    def to_keys(ids: torch.Tensor) -> torch.Tensor:  # ids index the main pool, then the extra one
        keys = gather_v4(kv_cache, ids.clamp_max(max(main_slots - 1, 0)))
        if extra_kv_cache is not None:
            in_extra = (ids >= main_slots).unsqueeze(-1)
            keys = torch.where(in_extra, gather_v4(extra_kv_cache, (ids - main_slots).clamp(0, extra_slots - 1)), keys)
        return keys.to(cdtype)

    flat = None if extra_indices is None else extra_indices.reshape(b * s_q, -1)
    rows = _union(indices.reshape(b * s_q, -1), per_row(topk_length), main_slots, flat, per_row(extra_topk_length),
                  extra_slots)
    table = torch.arange(max(main_slots + extra_slots, 1), device=q.device)  # gathered ids go to to_keys
    out, lse = _attend_union(q.reshape(b * s_q, h_q, d), table, to_keys, rows, sm_scale, attn_sink)
    return out.view(b, s_q, h_q, d), lse.view(b, s_q, h_q).transpose(1, 2).contiguous()
