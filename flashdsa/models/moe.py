"""Feed-forward blocks: the SwiGLU MLP of the dense layers and DeepSeek's MoE.

MoE routing (DeepSeek-V3): s = sigmoid(x W_gate^T) per expert; the choice uses s + bias (the
load-balancing correction), first keeping the ``topk_group`` expert groups with the largest sum
of their two best scores, then the ``num_experts_per_tok`` best experts inside them. The chosen
experts' *uncorrected* scores, normalized to sum 1 and times ``routed_scaling_factor``, weight
their outputs; one shared expert is always added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdsa.models.config import DeepseekV32Config


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); ``x: [T, hidden]``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Group-limited top-k over sigmoid scores; returns (weights [T, k] fp32, experts [T, k] int64)."""

    def __init__(self, config: DeepseekV32Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E], routing runs in fp32
        biased = scores + self.e_score_correction_bias
        groups = biased.view(-1, c.n_group, c.n_routed_experts // c.n_group)  # [T, G, E/G]
        group_score = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept_groups = group_score.topk(c.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_score).scatter_(1, kept_groups, 1.0).bool()
        biased = biased.masked_fill(~group_mask[:, :, None].expand_as(groups).reshape(biased.shape), float("-inf"))
        experts = biased.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, experts)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, experts


class MoE(nn.Module):
    """Routed experts plus the shared expert; ``x: [T, hidden]`` -> ``[T, hidden]``."""

    def __init__(self, config: DeepseekV32Config):
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)  # [T, k] each
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():  # only the experts some token chose
            token, slot = torch.where(experts == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out + self.shared_experts(x)
