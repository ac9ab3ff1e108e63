"""DeepSeek-V4's MoE: score-routed or hash-routed experts plus one shared expert, SwiGLU clipped.

Scores are ``sqrtsoftplus(x W_gate^T)`` (or sigmoid / softmax, per ``scoring_func``). A routed
layer picks the ``num_experts_per_tok`` best of ``score + e_score_correction_bias``; a hash layer
takes the experts ``tid2eid[token id]`` fixed at training. Either way the chosen experts' scores,
normalized to sum 1 and times ``routed_scaling_factor``, weight their outputs. Every expert (and
the shared one) computes ``down(silu(min(gate, L)) * clamp(up, -L, L))`` with ``L = swiglu_limit``.

Experts are stacked as transformers stores them: ``gate_up_proj [E, 2I, H]`` (gate rows, then up
rows) and ``down_proj [E, H, I]``. Two ways to run the routed experts (:class:`DeepseekV4MoE`):
the fused path, ``runtime.moe.fused_moe`` (Triton grouped GEMMs on a GPU, the clip in their
epilogue, no host sync), and the reference loop (:meth:`Experts.forward`, each used expert on its
tokens in turn, a host sync per step; differentiable, for reference mode and fine-tuning).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdsa.models.deepseek_v4_config import DeepseekV4Config
from flashdsa.runtime.moe import fused_moe


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, intermediate: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clipped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """``x: [T, H]`` (and the token ids for hash routing) -> (weights [T, k] fp32, experts [T, k] int32),
    on the device: no host sync."""

    def __init__(self, config: DeepseekV4Config, hashed: bool):
        super().__init__()
        c = config
        self.top_k, self.scoring, self.scale, self.hashed = c.num_experts_per_tok, c.scoring_func, c.routed_scaling_factor, hashed
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.empty(c.vocab_size, c.num_experts_per_tok, dtype=torch.int64))
        else:
            self.register_buffer("e_score_correction_bias", torch.empty(c.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight.to(x.dtype)).float()
        if self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = torch.sigmoid(logits) if self.scoring == "sigmoid" else F.softplus(logits).sqrt()
        if self.hashed:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        return weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scale, experts.to(torch.int32)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x: [T, H]``, ``weights, experts: [T, k]`` -> ``sum_k weights * expert_k(x)``, ``[T, H]``."""
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():  # reference mode: host-side loop over the used experts
            token, slot = torch.where(experts == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e].to(x.dtype)).chunk(2, dim=-1)
            y = F.linear(clipped_swiglu(gate, up, self.limit), self.down_proj[e].to(x.dtype))
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out


class DeepseekV4MoE(nn.Module):
    """Routed experts plus the shared expert; ``x: [T, H]`` -> ``[T, H]``.

    The model does not tell the MoE its mode, so the MoE decides from what it is given: bf16
    activations with autograd off (production mode, whose weights are bf16) run the routed experts
    through ``fused_moe``, graph-capturable (no host sync); anything else (fp32 reference mode,
    or autograd on: fine-tuning) runs the differentiable reference loop. A bf16 model in reference
    mode therefore takes the fused path too: it computes the same function, in fp32 accumulation."""

    def __init__(self, config: DeepseekV4Config, hashed: bool):
        super().__init__()
        c = config
        self.gate = Router(c, hashed)
        self.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.swiglu_limit)
        self.shared_experts = SharedExpert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x: [T, H]``, ``input_ids: [T]`` (hash routing reads them) -> ``[T, H]``."""
        weights, experts = self.gate(x, input_ids)
        if x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
            routed = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, experts,
                               swiglu_limit=self.experts.limit)
        else:
            routed = self.experts(x, weights, experts)
        return routed + self.shared_experts(x)
