"""DeepSeek-V4's training forward: whole sequences ``[B, L]``, no cache, under autograd.

The inference model's own modules and weights over the batch flattened to T = B * L tokens:
embedding copied into ``hc_mult`` streams, each ``DecoderLayer.forward`` (hyper-connections, norms,
hash or score-routed MoE) around the training attention of ``attention_v4`` (sliding window,
HCA, CSA dense or sparse, sinks), the hyper head, final norm and lm_head. Given the tokens that
follow the inputs, the first MTP layer runs on the last layer's streams and returns its draft
logits too. The indexer KL is the mean over the CSA layers (the MTP layer is a sliding one).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from flashdsa.train.attention_v4 import V4Step, v4_attention
from flashdsa.train.forward import TrainOutput, bound_forward, token_positions


def training_forward_v4(
    model,
    input_ids: torch.Tensor,
    attention: str = "dense",
    indexer_loss: bool = False,
    checkpointing: bool = False,
    backend: Optional[str] = None,
    next_ids: Optional[torch.Tensor] = None,
) -> TrainOutput:
    """Run ``model`` (a ``DeepseekV4ForCausalLM``) on ``input_ids: [B, L]`` int64 for training.

    attention: "dense" (CSA layers attend to every visible compressed entry) or "sparse" (to the
    indexer's top-k, as inference does). indexer_loss: also return the CSA indexers' KL.
    checkpointing: recompute each layer in the backward. backend: None or "reference" (the only
    V4 attention with a backward). next_ids: [B, L] int64, the token after each input: runs the MTP layer.
    """
    if backend not in (None, "reference"):
        raise ValueError(f"backend must be None or 'reference' for DeepSeek-V4 training (no V4 attention backward "
                         f"kernel exists), got {backend!r}")
    batch, length, positions = token_positions(input_ids, attention)
    sequence = torch.arange(batch, device=input_ids.device).repeat_interleave(length)
    step = V4Step(batch, length, positions, sequence, model.ropes, {k: rope(positions) for k, rope in model.ropes.items()},
                  attention, indexer_loss)
    return bound_forward(model, model_forward_v4)(input_ids, next_ids, step, checkpointing)


def model_forward_v4(model, input_ids: torch.Tensor, next_ids: Optional[torch.Tensor], step: V4Step,
                     checkpointing: bool) -> TrainOutput:
    """Embedding, every layer, hyper head, final norm and head over ``input_ids: [B, L]``; then,
    given ``next_ids``, the first MTP layer over the last layer's streams and the next tokens."""
    ids = input_ids.flatten()
    h = model.model.embed_tokens(ids).unsqueeze(1).expand(-1, model.config.hc_mult, -1).contiguous()  # [T, n, D]
    losses = []
    for layer in model.model.layers:
        h, kl = _run_layer(layer, h, ids, step, checkpointing)
        losses += [] if kl is None else [kl]
    shape = (step.batch, step.length, -1)
    logits = model.lm_head(model.model.norm(model.model.hc_head(h))).float().view(shape)
    mtp_logits = None
    if next_ids is not None and model.has_mtp:
        mtp, following = model.mtp[0], next_ids.flatten()
        g, _ = _run_layer(mtp, mtp.combine(model.model.embed_tokens(following), h), following, step, checkpointing)
        mtp_logits = model.lm_head(mtp.norm(mtp.hc_head(g))).float().view(shape)
    kl = None
    if step.indexer_loss:
        kl = torch.stack(losses).mean() if losses else logits.new_zeros(())
    return TrainOutput(logits, kl, mtp_logits)


def _run_layer(layer, h: torch.Tensor, ids: torch.Tensor, step: V4Step, checkpointing: bool):
    """One layer (its FSDP-sharded forward when wrapped), recomputed in the backward when asked."""
    forward = bound_forward(layer, layer_forward_v4)
    if checkpointing and torch.is_grad_enabled():
        return checkpoint(forward, h, ids, step, use_reentrant=False)
    return forward(h, ids, step)


def layer_forward_v4(layer, h: torch.Tensor, ids: torch.Tensor, step: V4Step) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One decoder layer: ``h: [T, hc_mult, hidden]``, ``ids: [T]`` -> (new streams, indexer KL or None)."""
    kl = []

    def attend(x: torch.Tensor) -> torch.Tensor:
        y, loss = v4_attention(layer.self_attn, x, step)
        kl.append(loss)
        return y

    return layer.forward(h, ids, attend), kl[0]  # not layer(...): under FSDP this runs inside its sharded forward
