"""Reference MoE ops in torch (any device): the ground truth of the triton backend.

select_experts, hash_experts and swiglu are torch ops that never sync (the triton backend: one
kernel each). align_tokens and fused_moe loop over the experts, reading each expert's pairs back
to the host: clear, but one sync per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdsa.runtime.fp4 import dequantize_fp4
from flashdsa.runtime.gemm import fp8_gemm, quantize_activations
from flashdsa.runtime.gemm.reference import dequantize_weight
from flashdsa.runtime.moe.alignment import AlignedPairs

NORM_EPS = 1e-20  # added to the sum of the chosen scores before normalizing, as DeepSeek does


def _descending(x: torch.Tensor) -> torch.Tensor:
    """Column order of each row of ``x`` by descending value, ties to the lower column."""
    return x.sort(dim=-1, descending=True, stable=True).indices


def routing_scores(router_logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The experts' scores ``[T, E]`` fp32 of fp32 (or bf16/fp16, widened) logits: sigmoid
    (DeepSeek-V3), sqrt(softplus) or softmax (V4's options)."""
    router_logits = router_logits.float()
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(router_logits).sqrt()
    return router_logits.softmax(dim=-1) if scoring == "softmax" else router_logits.sigmoid()


def select_experts(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                   norm_topk_prob: bool, routed_scaling_factor: float,
                   scoring: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    scores = routing_scores(router_logits, scoring)  # [T, E]
    choice = scores + bias  # the load-balancing correction steers the choice, not the weights
    tokens, experts = choice.shape
    if topk_group < n_group:  # keep the groups with the largest sum of their two best scores
        groups = choice.view(tokens, n_group, experts // n_group)
        group_score = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept = _descending(group_score)[:, :topk_group]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        choice = groups.masked_fill(~keep[:, :, None], float("-inf")).view(tokens, experts)
    expert_ids = _descending(choice)[:, :top_k]  # [T, k]
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return weights * routed_scaling_factor, expert_ids.to(torch.int32)


def hash_experts(router_logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor,
                 routed_scaling_factor: float, scoring: str = "sqrtsoftplus") -> tuple[torch.Tensor, torch.Tensor]:
    vocab, num_experts = tid2eid.shape[0], router_logits.shape[1]
    known = ((input_ids >= 0) & (input_ids < vocab))[:, None]
    ids = tid2eid[input_ids.clamp(0, vocab - 1)].long()  # [T, k]
    ids = torch.where(known & (ids >= 0) & (ids < num_experts), ids, -1)
    scores = routing_scores(router_logits, scoring).gather(1, ids.clamp(min=0))
    weights = torch.where(ids >= 0, scores, 0.0)
    return weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS) * routed_scaling_factor, ids.to(torch.int32)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:  # DeepSeek-V4's clip; torch rounds the bound to the tensors' dtype
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def align_tokens(expert_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int) -> AlignedPairs:
    flat = expert_ids.flatten()
    sorted_pairs = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=flat.device)
    block_experts = torch.full((num_blocks,), -1, dtype=torch.int32, device=flat.device)
    block = 0
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten()  # ascending
        if pairs.numel():
            row = block * block_m
            sorted_pairs[row:row + pairs.numel()] = pairs.to(torch.int32)
            used = -(-pairs.numel() // block_m)
            block_experts[block:block + used] = e
            block += used
    return AlignedPairs(sorted_pairs, block_experts)


def _linear(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, pow2_scales: bool,
            quantize: bool) -> torch.Tensor:
    """``a: [n, K] @ w: [N, K]^T`` in fp32. Packed FP4 ``w`` ([N, K/2] uint8, its scales [N, K/32]):
    dequantized in fp32 (the GPU path scales each group's fp32 partial sum, so fp32 scales do not
    round the weights either). FP8 ``w`` (with its 128x128 block scales ``w_scale``): ``quantize`` first quantizes
    ``a`` per token and 128 channels, as the GPU path does; otherwise ``w`` is dequantized."""
    if w_scale is None:
        return a.float() @ w.float().T
    if w.dtype == torch.uint8:
        return a.float() @ dequantize_fp4(w, w_scale).T
    if not quantize:
        return a.float() @ dequantize_weight(w, w_scale).T
    a_fp8, a_scale = quantize_activations(a, pow2_scales=pow2_scales, backend="reference")
    return fp8_gemm(a_fp8, a_scale, w, w_scale, torch.float32, backend="reference")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              expert_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
              pow2_scales: bool, quantize: bool, out: torch.Tensor | None, *,
              swiglu_limit: float | None = None) -> torch.Tensor:
    tokens, top_k = expert_ids.shape
    inter = w13.shape[1] // 2
    pair_out = torch.zeros(tokens, top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = (expert_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        scale13 = None if w13_scale is None else w13_scale[e]
        scale2 = None if w2_scale is None else w2_scale[e]
        gate_up = _linear(x[token], w13[e], scale13, pow2_scales, quantize)  # [n, 2I] fp32
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if swiglu_limit is not None:  # DeepSeek-V4's clipped SwiGLU
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        h = (F.silu(gate) * up).to(x.dtype)  # stored in x's dtype
        y = _linear(h, w2[e], scale2, pow2_scales, quantize) * weights[token, slot, None]
        pair_out[token, slot] = y.to(x.dtype).float()  # each pair's output is stored in x's dtype
    result = pair_out.sum(dim=1).to(x.dtype)  # fp32 sum over the k pairs of each token
    return result if out is None else out.copy_(result)
