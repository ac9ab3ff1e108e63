"""Sparse MLA backward with the native dkv half (``sparse_bwd.cu``): per chunk of query tokens the
Triton dq kernel (``kernels.triton.sparse_bwd``) forms P and dS in bf16 scratch and accumulates dq;
the native kernels then multiply them into dkv with wgmma (dS^T q + P^T dout, the heads as K) and
add the rows with vector reductions, or store them per (token, slot) for the deterministic sum.
Importing this module builds the kernels' native extension once (``flashdsa.runtime.native``); a
failed build raises ImportError, so dispatch falls back to Triton and says why."""

from __future__ import annotations

import torch

from flashdsa.runtime import native
from flashdsa.runtime.cache.layout import KV_LORA_RANK
from flashdsa.runtime.kernels.triton import sparse_bwd as triton_bwd

native.load("kernels")


def native_dkv(q: torch.Tensor, dout: torch.Tensor, idx2: torch.Tensor, p_buf: torch.Tensor, ds_buf: torch.Tensor,
               rows: torch.Tensor, s_kv: int, token0: int, tokens: int, deterministic: bool) -> None:
    """The native dkv step (a ``triton_bwd.DkvStage``); ``s_kv`` is ``rows``' height when atomic."""
    stream = torch._C._cuda_getCurrentRawStream(q.device.index)
    torch.ops.flashdsa.sparse_bwd_dkv_cuda(q, dout, idx2, p_buf, ds_buf, rows, token0, tokens, deterministic, stream)


def sparse_mla_bwd(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                   indices: torch.Tensor, sm_scale: float, d_v: int = KV_LORA_RANK, deterministic: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [s_q, h_q, d_qk], dkv [s_kv, 1, d_qk]) in bf16, accumulated in fp32.

    As ``kernels.triton.sparse_bwd.sparse_mla_bwd`` (inputs validated by the public op), for h_q 64
    or 128, d_qk 512 or 576, d_v 512 and topk a multiple of 64 up to the Triton dq kernel's 8192.
    """
    if d_v != KV_LORA_RANK:
        raise ValueError(f"cuda sparse_mla_bwd needs d_v {KV_LORA_RANK}, got {d_v}")
    return triton_bwd.sparse_mla_bwd(q.contiguous(), kv, out.contiguous(), dout.contiguous(), lse, indices, sm_scale,
                                     d_v, deterministic, dkv_stage=native_dkv)
