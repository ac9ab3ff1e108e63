"""Sparse MLA attention as a differentiable op: the forward and backward kernels under autograd.

MQA ("absorbed") mode: every query head reads the same 576-wide latent rows of ``kv``; the first
``d_v`` columns of each row are also its value. Gradients flow to ``q`` and ``kv`` only (the
indices come from the indexer's top-k and are not differentiable).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime.kernels import sparse_mla_bwd, sparse_mla_fwd


class SparseMLAFunction(torch.autograd.Function):
    """``(out, lse) = sparse attention(q, kv, indices)``; see ``sparse_mla_attention``."""

    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale, d_v, backend):
        out, _, lse = sparse_mla_fwd(q, kv, indices, sm_scale, d_v, backend=backend)
        ctx.save_for_backward(q, kv, out, lse, indices)
        ctx.sm_scale, ctx.d_v, ctx.backend = sm_scale, d_v, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, out, lse, indices = ctx.saved_tensors
        dq, dkv = sparse_mla_bwd(
            q, kv, out, dout.contiguous(), lse, indices, ctx.sm_scale, ctx.d_v, backend=ctx.backend
        )
        return dq, dkv, None, None, None, None


def sparse_mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable sparse MLA attention.

    q: [s_q, h_q, d_qk], kv: [s_kv, 1, d_qk] (bf16 on GPU; fp32/fp64 with the reference backend),
    indices: [s_q, 1, topk] int32 rows of kv each query attends to (< 0 or >= s_kv: ignored).
    Returns out [s_q, h_q, d_v] (q's dtype, differentiable w.r.t. q and kv) and the natural-log
    lse [s_q, h_q] fp32 of the scaled scores (not differentiable; +inf for a row with no valid index).
    """
    return SparseMLAFunction.apply(q.contiguous(), kv.contiguous(), indices.contiguous(), sm_scale, d_v, backend)
