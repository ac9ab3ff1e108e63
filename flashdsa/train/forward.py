"""The model's training forward: whole sequences ``[B, L]``, no cache, dense or sparse attention.

It reuses the inference model's own modules and weights (projections, norms, MLP/MoE, indexer
projections, RoPE), running each layer's MLA in MQA (absorbed) form over the batch flattened to
T = B * L tokens:

    q = [W_UK^T q_nope ; rope(q_pe)]  [T, H, 576]     kv = [RMSNorm(c_kv) ; rope(k_pe)]  [T, 576]
    dense:  causal softmax attention of q over the kv of the same sequence
    sparse: each query attends to the top-k keys of its indexer scores (causal, indices
            detached) through the sparse kernels' autograd function

The indexer (``flashdsa.train.indexer``) scores without Hadamard or FP8 (the reference
computation), from detached inputs, so its KL loss trains the indexer alone. Given the tokens that
follow the inputs, the MTP layer (``models/mtp.py``) runs after the main stack on its final-normed
hidden states, in the same attention mode, and returns its draft logits too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flashdsa.models.rope import RopeAt
from flashdsa.train.autograd import sparse_mla_attention
from flashdsa.train.indexer import IndexerInputs, causal_scores, indexer_inputs, select_topk, selected_scores
from flashdsa.train.losses import dense_attention_target, indexer_kl, selected_attention_target

ATTENTION_MODES = ("dense", "sparse")
SHARDED_FORWARD = "sharded_training_forward"  # the method name FSDP2 wraps on sharded modules


@dataclass
class TrainOutput:
    """logits: [B, L, vocab] fp32; indexer_kl: mean over layers (the MTP layer's included) of the
    indexer KL (None if not asked); mtp_logits: [B, L, vocab] fp32, row i predicting token i + 2
    (None without the MTP layer or ``next_ids``)."""

    logits: torch.Tensor
    indexer_kl: Optional[torch.Tensor]
    mtp_logits: Optional[torch.Tensor] = None


@dataclass
class _Step:
    """What every layer of one forward needs besides its input."""

    batch: int
    length: int
    rope: RopeAt
    attention: str
    indexer_loss: bool
    dtype: torch.dtype  # dtype of q and kv handed to attention (bf16 on GPU)
    backend: Optional[str]
    checkpointing: bool  # recompute each layer in the backward
    next_ids: Optional[torch.Tensor] = None  # [B, L]: the token after each input (runs the MTP layer)


def training_forward(
    model,
    input_ids: torch.Tensor,
    attention: str = "dense",
    indexer_loss: bool = False,
    checkpointing: bool = False,
    attention_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    next_ids: Optional[torch.Tensor] = None,
) -> TrainOutput:
    """Run ``model`` (a ``DeepseekV32ForCausalLM``) on ``input_ids: [B, L]`` int64 for training.

    attention: "dense" (causal softmax over all keys) or "sparse" (indexer top-k keys).
    indexer_loss: also return the indexer KL (over all causal keys when dense, the selected ones when sparse).
    checkpointing: recompute each layer in the backward instead of keeping its activations.
    attention_dtype: dtype of q/kv in attention (default: bf16 on CUDA, else the weights' dtype).
    next_ids: [B, L] int64, the token after each input token: runs the model's MTP layer too.
    """
    batch, length, positions = token_positions(input_ids, attention)
    weight_dtype = model.lm_head.weight.dtype
    default_dtype = torch.bfloat16 if input_ids.is_cuda else weight_dtype
    step = _Step(batch, length, model.rotary.at(positions), attention, indexer_loss,
                 attention_dtype or default_dtype, backend, checkpointing, next_ids)
    return bound_forward(model, model_forward)(input_ids, step)


def token_positions(input_ids: torch.Tensor, attention: str) -> tuple[int, int, torch.Tensor]:
    """(B, L, the position of each of the T = B * L tokens ``[T]``) of ``input_ids: [B, L]`` int64;
    ValueError naming ``input_ids`` or ``attention`` when they are not a training forward's."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise ValueError(f"input_ids must be int64 [B, L], got {input_ids.dtype} {list(input_ids.shape)}")
    batch, length = input_ids.shape
    return batch, length, torch.arange(length, device=input_ids.device).repeat(batch)


def bound_forward(module, forward):
    """``forward`` bound to ``module``: its FSDP-wrapped ``SHARDED_FORWARD`` when it has one."""
    return getattr(module, SHARDED_FORWARD, None) or partial(forward, module)


def model_forward(model, input_ids: torch.Tensor, step: _Step) -> TrainOutput:
    """Embedding, every layer, final norm and head over ``input_ids: [B, L]``; then, given
    ``step.next_ids``, the MTP layer over the final-normed hidden states and the next tokens."""
    h = model.model.embed_tokens(input_ids.flatten())  # [T, hidden]
    losses = []
    for layer in model.model.layers:
        h, kl = _run_layer(layer, h, step)
        losses.append(kl)
    h = model.model.norm(h)
    logits = model.lm_head(h).float().view(step.batch, step.length, -1)
    mtp_logits = None
    if step.next_ids is not None and model.has_mtp:
        mtp = model.model.mtp
        g, kl = _run_layer(mtp, mtp.combine(model.model.embed_tokens(step.next_ids.flatten()), h), step)
        losses.append(kl)
        mtp_logits = model.lm_head(mtp.shared_head.norm(g)).float().view(step.batch, step.length, -1)
    return TrainOutput(logits, torch.stack(losses).mean() if step.indexer_loss else None, mtp_logits)


def _run_layer(layer, h: torch.Tensor, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer (its FSDP-sharded forward when wrapped), recomputed in the backward when
    ``step.checkpointing``."""
    forward = bound_forward(layer, layer_forward)
    if step.checkpointing and torch.is_grad_enabled():
        return checkpoint(forward, h, step, use_reentrant=False)
    return forward(h, step)


def layer_forward(layer, h: torch.Tensor, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer: h: [T, hidden] -> (h after attention and MLP, indexer KL scalar or 0)."""
    attn_out, kl = _mla(layer.self_attn, layer.input_layernorm(h), step)
    h = h + attn_out
    return h + layer.mlp(layer.post_attention_layernorm(h)), kl


def _mla(attn, x: torch.Tensor, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    """One MLA block over x: [T, hidden] -> ([T, hidden], indexer KL scalar or 0)."""
    c, T, H = attn.config, x.shape[0], attn.n_heads
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))  # [T, q_lora_rank]
    q_nope, q_pe = attn.q_b_proj(q_resid).view(T, H, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
    c_kv = attn.kv_a_layernorm(c_kv)  # [T, 512]
    q_pe, k_pe = step.rope(q_pe, k_pe, interleaved=True)
    w_uk, w_uv = attn.kv_b_proj.weight.view(H, -1, c.kv_lora_rank).split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
    q_lat = torch.einsum("thd,hdc->thc", q_nope, w_uk.to(q_nope.dtype))  # [T, H, 512]
    q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1).to(step.dtype)  # [T, H, 576]
    kv = torch.cat([c_kv, k_pe.to(c_kv.dtype)], dim=-1).to(step.dtype)  # [T, 576]

    index = None  # the indexer's q, k, w from detached inputs: its KL reaches the indexer only
    if step.attention == "sparse" or step.indexer_loss:
        index = indexer_inputs(attn.indexer, x.detach(), q_resid.detach(), step.rope, step.batch)
    attend = _sparse_branch if step.attention == "sparse" else _dense_branch
    o_lat, kl = attend(q, kv, index, c, step)  # [T, H, 512], KL scalar (0 when not asked)
    o = torch.einsum("thc,hdc->thd", o_lat.to(x.dtype), w_uv.to(x.dtype))  # [T, H, v_head_dim]
    return attn.o_proj(o.flatten(1)), kl


def _sparse_branch(q, kv, index: IndexerInputs, c, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k attention of q: [T, H, d_qk] over kv: [T, d_qk] through the sparse kernels, and the
    indexer KL over the selected keys."""
    T = q.shape[0]
    local = select_topk(index, c.index_topk)  # [B, L, K] positions, -1 padded
    offsets = (torch.arange(step.batch, device=q.device) * step.length)[:, None, None]
    rows = torch.where(local >= 0, local + offsets, -1).view(T, -1).to(torch.int32)  # rows of the flat kv
    o_lat, lse = sparse_mla_attention(q, kv[:, None], rows[:, None], c.softmax_scale, c.kv_lora_rank, step.backend)
    kl = q.new_zeros((), dtype=torch.float32)
    if step.indexer_loss:
        target = selected_attention_target(q.detach(), kv.detach(), rows, lse, c.softmax_scale)
        kl = indexer_kl(target, selected_scores(index, local).view(T, -1), rows >= 0)
    return o_lat, kl


def _dense_branch(q, kv, index: IndexerInputs, c, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over every key, and the indexer KL over every causal key."""
    o_lat = _dense_attention(q, kv, step, c.softmax_scale, c.kv_lora_rank)
    kl = q.new_zeros((), dtype=torch.float32)
    if step.indexer_loss:
        shape = (step.batch, step.length)
        target = dense_attention_target(q.view(*shape, q.shape[1], -1), kv.view(*shape, -1), c.softmax_scale)
        scores = causal_scores(index)  # [B, L, L]
        kl = indexer_kl(target, scores, torch.isfinite(scores))
    return o_lat, kl


def _dense_attention(q: torch.Tensor, kv: torch.Tensor, step: _Step, scale: float, d_v: int) -> torch.Tensor:
    """Causal attention of q: [T, H, d_qk] over kv: [T, d_qk] within each sequence -> [T, H, d_v]."""
    B, L, H = step.batch, step.length, q.shape[1]
    q = q.view(B, L, H, -1).transpose(1, 2)  # [B, H, L, d_qk]
    k = kv.view(B, 1, L, -1).expand(B, H, L, kv.shape[-1])
    out = F.scaled_dot_product_attention(q, k, k[..., :d_v], is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(B * L, H, d_v)
