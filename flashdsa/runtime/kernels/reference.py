"""Reference (torch) sparse MLA attention: the ground truth every GPU kernel is checked against.

Runs on any device in fp32 (fp64 when the inputs are fp64, so gradients can be checked in double
precision). Query rows are processed in chunks sized from ``MEMORY_BUDGET``, so a 4096-token
prefill with topk 2048 and 128 heads never holds more than a few hundred MiB of intermediates.
An index outside ``[0, n_kv)`` is masked: it is clamped to row 0 before the gather (so nothing is
read out of bounds), its key is zeroed (whatever row 0 holds, NaN included, cannot leak into out
or the gradients through a zero weight) and its score is -inf. The public, validated entry
points live in ``flashdsa.runtime.kernels``; these functions trust their inputs.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from flashdsa.runtime.cache.layout import MLA_TOKEN_BYTES, dequantize_mla

MEMORY_BUDGET = 256 * 2**20  # bytes of intermediates per chunk of query rows

ToKeys = Callable[[torch.Tensor], torch.Tensor]  # gathered table rows [n, topk, w] -> keys [n, topk, d_qk]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(h_q: int, topk: int, d_qk: int, dtype: torch.dtype, chunk: Optional[int]) -> int:
    """Query rows per chunk: ``chunk`` when given, else as many as fit in ``MEMORY_BUDGET``."""
    if chunk is not None:
        return max(1, chunk)
    # gathered keys and their gradients, four [h_q, topk] score-shaped terms, q/out/grad rows
    per_row = (3 * topk * d_qk + 4 * h_q * topk + 4 * h_q * d_qk) * torch.finfo(dtype).bits // 8
    return max(1, MEMORY_BUDGET // per_row)


def _nonempty(table: torch.Tensor) -> torch.Tensor:
    """``table`` itself, or one zero row when it is empty, so a clamped index 0 is always readable."""
    return table if table.shape[0] else table.new_zeros(1, *table.shape[1:])


def _gather_keys(
    table: torch.Tensor, to_keys: ToKeys, idx: torch.Tensor, n_kv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys selected by ``idx: [n, topk]``: (valid [n, topk] bool, clamped indices [n, topk] int64,
    keys [n, topk, d_qk])."""
    idx = idx.long()
    valid = (idx >= 0) & (idx < n_kv)
    safe = torch.where(valid, idx, 0)
    keys = to_keys(_nonempty(table)[safe]).masked_fill(~valid[..., None], 0)  # row 0 may hold anything (NaN)
    return valid, safe, keys


def _scores(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Scaled scores ``[n, h_q, topk]`` of ``q: [n, h_q, d_qk]``, -inf where the index is invalid."""
    s = torch.einsum("nhd,ntd->nht", q, keys) * sm_scale
    return s.masked_fill(~valid[:, None, :], float("-inf"))


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Softmax weights ``exp(s - lse)``; all zero on rows without a valid index (lse = +-inf)."""
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    return torch.exp(scores - lse.unsqueeze(-1))


def _attend(
    q: torch.Tensor, table: torch.Tensor, to_keys: ToKeys, indices: torch.Tensor, sm_scale: float, d_v: int,
    chunk: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention of ``q: [n, h_q, d_qk]`` over rows ``indices: [n, topk]`` of ``table``.

    Returns out ``[n, h_q, d_v]`` (q's dtype), max_logits and lse ``[n, h_q]`` fp32.
    """
    n, h_q, d_qk = q.shape
    cdtype = _compute_dtype(q.dtype)
    out = q.new_empty(n, h_q, d_v)
    max_logits = q.new_empty(n, h_q, dtype=torch.float32)
    lse = torch.empty_like(max_logits)
    rows = _rows_per_chunk(h_q, indices.shape[-1], d_qk, cdtype, chunk)
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        valid, _, keys = _gather_keys(table, to_keys, indices[part], table.shape[0])
        s = _scores(q[part].to(cdtype), keys, valid, sm_scale)
        lse_part = torch.logsumexp(s, dim=-1)
        out[part] = torch.einsum("nht,ntv->nhv", _probs(s, lse_part), keys[..., :d_v]).to(q.dtype)
        max_logits[part] = s.amax(dim=-1).float()
        lse[part] = lse_part.masked_fill(lse_part == float("-inf"), float("inf")).float()
    return out, max_logits, lse


def _kv_rows(kv: torch.Tensor) -> tuple[torch.Tensor, ToKeys]:
    """``kv: [s_kv, 1, d_qk]`` as a gather table and its (identity) key conversion."""
    cdtype = _compute_dtype(kv.dtype)
    return kv[:, 0], lambda rows: rows.to(cdtype)


def sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
    *, chunk: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[s_q, h_q, d_qk]``, kv ``[s_kv, 1, d_qk]``, indices ``[s_q, 1, topk]`` int32 ->
    (out ``[s_q, h_q, d_v]``, max_logits ``[s_q, h_q]`` fp32, lse ``[s_q, h_q]`` fp32).

    ``chunk`` forces the number of query rows per chunk (tests); None sizes it from the budget.
    """
    table, to_keys = _kv_rows(kv)
    return _attend(q, table, to_keys, indices[:, 0], sm_scale, d_v, chunk)


def sparse_mla_bwd(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    indices: torch.Tensor, sm_scale: float, d_v: int = 512, deterministic: bool = False,
    *, chunk: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dq ``[s_q, h_q, d_qk]``, dkv ``[s_kv, 1, d_qk]``, inputs' dtype) of
    :func:`sparse_mla_fwd`'s out, written out explicitly (no autograd):

    P = exp(S - lse), dP = dO V^T, delta = rowsum(dO * O), dS = P (dP - delta) sm_scale,
    dq = dS K, dK = dS^T q over the full d_qk plus dV = P^T dO on the first d_v columns,
    scattered back to the selected kv rows (duplicates accumulate). fp32 (fp64) accumulation.
    ``deterministic`` is accepted for API parity: chunks run in a fixed order and the scatter is
    ``index_put_(accumulate=True)``, which PyTorch implements deterministically.
    """
    s_q, h_q, d_qk = q.shape
    table, to_keys = _kv_rows(kv)
    n_kv = kv.shape[0]
    cdtype = _compute_dtype(q.dtype)
    dq = torch.empty_like(q)
    dkv = torch.zeros(max(n_kv, 1), d_qk, dtype=cdtype, device=q.device)
    rows = _rows_per_chunk(h_q, indices.shape[-1], d_qk, cdtype, chunk)
    for start in range(0, s_q, rows):
        part = slice(start, start + rows)
        valid, safe, keys = _gather_keys(table, to_keys, indices[part, 0], n_kv)
        q_c, do_c = q[part].to(cdtype), dout[part].to(cdtype)
        p = _probs(_scores(q_c, keys, valid, sm_scale), lse[part].to(cdtype))
        dp = torch.einsum("nhv,ntv->nht", do_c, keys[..., :d_v])
        delta = (do_c * out[part].to(cdtype)).sum(dim=-1, keepdim=True)
        ds = p * (dp - delta) * sm_scale
        dq[part] = torch.einsum("nht,ntd->nhd", ds, keys).to(q.dtype)
        dk = torch.einsum("nht,nhd->ntd", ds, q_c)
        dk[..., :d_v] += torch.einsum("nht,nhv->ntv", p, do_c)
        dk = torch.where(valid.unsqueeze(-1), dk, 0.0)
        dkv.index_put_((safe.flatten(),), dk.flatten(0, 1), accumulate=True)
    return dq, dkv[:n_kv].to(kv.dtype).unsqueeze(1)


def sparse_mla_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
    *, chunk: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, s_q, h_q, 576]``, kv_cache ``[num_blocks, block_size, 1, 656]`` uint8 (FP8 MLA
    tokens), indices ``[b, s_q, topk]`` int32 slot ids -> (out ``[b, s_q, h_q, d_v]``,
    lse ``[b, h_q, s_q]`` fp32). Selected tokens are gathered by slot id and dequantized."""
    b, s_q, h_q, d_qk = q.shape
    table = kv_cache.view(-1, MLA_TOKEN_BYTES)
    cdtype = _compute_dtype(q.dtype)

    def to_keys(tokens: torch.Tensor) -> torch.Tensor:
        return dequantize_mla(tokens).to(cdtype)

    rows = indices.reshape(b * s_q, indices.shape[-1])
    out, _, lse = _attend(q.reshape(b * s_q, h_q, d_qk), table, to_keys, rows, sm_scale, d_v, chunk)
    return out.view(b, s_q, h_q, d_v), lse.view(b, s_q, h_q).transpose(1, 2).contiguous()
