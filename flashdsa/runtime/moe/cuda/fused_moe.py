"""Routed experts with FP4 weights at decode sizes through the native W4A8 kernels of ``fp4_moe.cu``.

Per call: the alignment into 16-row blocks (Triton), the activations quantized to e4m3 per token
and 128 channels (``runtime.gemm.quantize_activations``), the gate/up kernel writing
``silu(gate) * up`` as e4m3 with a scale per 32 channels, the down kernel writing each pair's
weighted row, and the Triton combine. The weights stay packed; each kernel turns e2m1 into e4m3
exactly in registers and multiplies on wgmma, so a decode step streams each chosen expert's bytes
once at 0.46-0.63 of the copy rate on an H100 (1.7-2.1x the Triton path, whose bf16 upcast is
compute-bound). Other calls (bf16 or FP8 weights, fp32 scales, or more than
``CUDA_MAX_PAIRS_PER_EXPERT`` pairs an expert, where the Triton tiles reuse the weights) run the
Triton path. Importing this module builds the extension once
(``flashdsa.runtime.native``); a failed build raises ImportError, so dispatch falls back to Triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import native
from flashdsa.runtime.gemm import quantize_activations
from flashdsa.runtime.moe import CUDA_MAX_PAIRS_PER_EXPERT
from flashdsa.runtime.moe.alignment import max_blocks
from flashdsa.runtime.moe.triton import fused_moe as triton_moe
from flashdsa.runtime.moe.triton.align import align_tokens

native.load("moe")

BLOCK_M = 16  # block rows of one expert (fp4_moe.cu's BLOCK_M)
H_GROUP = 32  # intermediate channels per scale of the e4m3 intermediate


def runs_natively(w13: torch.Tensor, w13_scale: Optional[torch.Tensor], pairs_per_expert: float) -> bool:
    """Whether the native kernels take this call: packed FP4 weights with UE8M0 scales at decode sizes."""
    return w13.dtype == torch.uint8 and w13_scale is not None and w13_scale.dtype == torch.uint8 and \
        pairs_per_expert <= CUDA_MAX_PAIRS_PER_EXPERT


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              expert_ids: torch.Tensor, w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor],
              pow2_scales: bool, quantize: bool, out: Optional[torch.Tensor], *,
              swiglu_limit: Optional[float] = None, chunk_tokens: int = triton_moe.CHUNK_TOKENS) -> torch.Tensor:
    """The public ``fused_moe`` (arguments checked there) on the native kernels, or on Triton's
    for calls they do not take (:func:`runs_natively`)."""
    tokens, top_k = expert_ids.shape
    if not runs_natively(w13, w13_scale, tokens * top_k / w13.shape[0]):
        return triton_moe.fused_moe(x, w13, w2, weights, expert_ids, w13_scale, w2_scale, pow2_scales, quantize,
                                    out, swiglu_limit=swiglu_limit, chunk_tokens=chunk_tokens)
    out = torch.empty_like(x) if out is None else out
    for start in range(0, tokens, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        _routed_experts(x[rows], w13, w2, weights[rows], expert_ids[rows], w13_scale, w2_scale, out[rows],
                        swiglu_limit)
    return out


def _routed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    expert_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor, out: torch.Tensor,
                    swiglu_limit: Optional[float]) -> None:
    """One chunk of tokens into ``out`` (row slices of contiguous tensors)."""
    tokens, top_k = expert_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    num_blocks = max_blocks(tokens * top_k, num_experts, BLOCK_M)
    aligned = align_tokens(expert_ids, num_experts, BLOCK_M, num_blocks)
    a, a_scale = quantize_activations(x)
    rows = num_blocks * BLOCK_M
    h = torch.empty(rows, inter, dtype=torch.uint8, device=x.device)
    h_scale = torch.empty(rows, inter // H_GROUP, dtype=torch.float32, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    torch.ops.flashdsa.fp4_moe_gate_up_cuda(a.view(torch.uint8), a_scale, w13, w13_scale, aligned.sorted_pairs,
                                            aligned.block_experts, top_k, swiglu_limit or 0.0, h, h_scale, stream)
    pair_out = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    torch.ops.flashdsa.fp4_moe_down_cuda(h, h_scale, w2, w2_scale, aligned.sorted_pairs, aligned.block_experts,
                                         weights.reshape(-1), pair_out, stream)
    triton_moe.combine_pairs(pair_out, expert_ids, num_experts, out)
