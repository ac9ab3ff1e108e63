"""Sparse MLA backward on Hopper's native kernels, per chunk of query tokens (the chunking and the
deterministic sum are the Triton backend's ``run_backward``):

- ``sparse_bwd_dq.cu``: dq, with P and dS left in bf16 scratch (one CTA per token and 64 heads,
  key rows gathered into shared memory, the scores and dq on wgmma);
- ``sparse_bwd_dkv.cu``: dkv = dS^T q + P^T dout from that scratch on wgmma (the heads as K), added
  with vector reductions or stored per (token, slot) for the deterministic sum.

Importing this module builds the kernels' native extension once (``flashdsa.runtime.native``); a
failed build raises ImportError, so dispatch falls back to Triton and says why."""

from __future__ import annotations

import torch

from flashdsa.runtime import native
from flashdsa.runtime.cache.layout import KV_LORA_RANK
from flashdsa.runtime.kernels.triton import sparse_bwd as triton_bwd

native.load("kernels")


def _stream(t: torch.Tensor) -> int:
    return torch._C._cuda_getCurrentRawStream(t.device.index)


def native_dq(q: torch.Tensor, kv2: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
              idx2: torch.Tensor, dq: torch.Tensor, p_buf: torch.Tensor, ds_buf: torch.Tensor, s_kv: int,
              sm_scale: float, token0: int, tokens: int) -> None:
    """The native dq step (a ``triton_bwd.DqStage``); ``s_kv`` is ``kv2``'s height."""
    torch.ops.flashdsa.sparse_bwd_dq_cuda(q, kv2, out, dout, lse, idx2, dq, p_buf, ds_buf, token0, tokens, sm_scale,
                                          _stream(q))


def native_dkv(q: torch.Tensor, dout: torch.Tensor, idx2: torch.Tensor, p_buf: torch.Tensor, ds_buf: torch.Tensor,
               rows: torch.Tensor, s_kv: int, token0: int, tokens: int, deterministic: bool) -> None:
    """The native dkv step (a ``triton_bwd.DkvStage``); ``s_kv`` is ``rows``' height when atomic."""
    torch.ops.flashdsa.sparse_bwd_dkv_cuda(q, dout, idx2, p_buf, ds_buf, rows, token0, tokens, deterministic,
                                           _stream(q))


def sparse_mla_bwd(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                   indices: torch.Tensor, sm_scale: float, d_v: int = KV_LORA_RANK, deterministic: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [s_q, h_q, d_qk], dkv [s_kv, 1, d_qk]) in bf16, accumulated in fp32.

    As ``kernels.triton.sparse_bwd.sparse_mla_bwd`` (inputs validated by the public op), for h_q 64
    or 128, d_qk 512 or 576, d_v 512 and topk a multiple of 64 (the dkv tiles; dq's are 32).
    """
    if d_v != KV_LORA_RANK:
        raise ValueError(f"cuda sparse_mla_bwd needs d_v {KV_LORA_RANK}, got {d_v}")
    q, kv, out, dout, indices = (_contiguous_aligned(t) for t in (q, kv, out, dout, indices))
    return triton_bwd.run_backward(q, kv, out, dout, lse.contiguous(), indices, sm_scale, deterministic, native_dq,
                                   native_dkv)


def _contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on a 16-byte boundary (the kernels' vector loads), copied if not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
