"""Fresh weights for training a model from scratch (the loader fills them from a checkpoint otherwise)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flashdsa.train.distributed import own_rows


@torch.no_grad()
def initialize(model: nn.Module, seed: int = 0, std: float = 0.02, depth: int | None = None) -> nn.Module:
    """Normal(0, std) for matrices and embeddings, scaled by 1/sqrt(2 * layers) for the residual
    outputs (o_proj, down_proj); ones for norm weights; zeros for biases and routing corrections.
    ``model`` is a whole model, or one layer (the MTP layer) with the model's ``depth`` given.
    Sharded (FSDP2) tensors get the rows of the one-process values this rank holds: each rank
    draws every tensor in full with the same generator and keeps its rows (one tensor at a time)."""
    generator = torch.Generator().manual_seed(seed)
    depth = depth or len(model.model.layers)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("norm.weight"):
            value = torch.ones(tensor.shape)
        elif tensor.dim() < 2:
            value = torch.zeros(tensor.shape)
        else:
            scale = std / (2 * depth) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else std
            value = torch.randn(tensor.shape, generator=generator) * scale
        if isinstance(tensor, DTensor):  # an FSDP2 shard: this rank's rows of the value
            tensor, start, stop = own_rows(tensor)
            value = value[start:stop]
        tensor.copy_(value.to(tensor.dtype))
    return model
