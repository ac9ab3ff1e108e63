"""Sparse MLA forward over bf16 key rows (prefill, training) through the native kernel of
``sparse_attention.cu``: the decode's kernel body (``sparse_decode``) with a producer that copies
the selected bf16 rows straight into shared memory (cp.async) instead of dequantizing FP8 tokens.
One CTA per query row and 64 heads, the whole top-k list in tiles of 64 keys; with 128 heads the
two head blocks of a row run as a 2-CTA cluster that reads each selected row once. Importing this
module builds the kernels' native extension once (``flashdsa.runtime.native``); a failed build
raises ImportError, so dispatch falls back to Triton and says why."""

from __future__ import annotations

import torch

from flashdsa.runtime import native
from flashdsa.runtime.cache.layout import KV_LORA_RANK

native.load("kernels")


def sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = KV_LORA_RANK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q: [s_q, h_q, d_qk] bf16 (h_q 64 or 128, d_qk 512 or 576), kv: [s_kv, 1, d_qk] bf16,
    indices: [s_q, 1, topk] int32 (topk <= 16384) -> (out [s_q, h_q, 512] bf16, max_logits and
    lse [s_q, h_q] fp32).

    Inputs are validated by the public op (the C++ op checks them again); this backend needs d_v
    512. CUDA-graph capturable (no host sync).
    """
    if d_v != KV_LORA_RANK:
        raise ValueError(f"cuda sparse_mla_fwd needs d_v {KV_LORA_RANK}, got {d_v}")
    s_q, h_q, _ = q.shape
    out = torch.empty(s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(max_logits)
    if s_q == 0:
        return out, max_logits, lse
    stream = torch._C._cuda_getCurrentRawStream(q.device.index)
    torch.ops.flashdsa.sparse_fwd_cuda(q.contiguous(), kv.contiguous(), indices.contiguous(), sm_scale, out,
                                       max_logits, lse, stream)
    return out, max_logits, lse
