"""Feed-forward blocks: the SwiGLU MLP of the dense layers and DeepSeek's MoE.

MoE routing (DeepSeek-V3): s = sigmoid(x W_gate^T) per expert; the choice uses s + bias (the
load-balancing correction), first keeping the ``topk_group`` expert groups with the largest sum
of their two best scores, then the ``num_experts_per_tok`` best experts inside them. The chosen
experts' *uncorrected* scores, normalized to sum 1 and times ``routed_scaling_factor``, weight
their outputs; one shared expert is always added.

The routed experts are stacked per layer for grouped GEMMs (``flashdsa.runtime.moe``):
``gate_up_proj: [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj: [E, H, I]``,
e4m3 with 128x128 block scales for FP8 checkpoints. ``state_dict`` and ``load_state_dict`` speak
the checkpoint's per-expert names (``experts.{e}.gate_proj.weight`` ...), so saved checkpoints keep
the Hugging Face layout. Routing, alignment and the GEMMs run on the device with no host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.linear import SCALE_SUFFIX
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP
from flashdsa.runtime.moe import fused_moe, select_experts
from flashdsa.runtime.parallel.shard import Shard



class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); ``x: [T, hidden]``. Under tensor parallelism each rank holds
    ``intermediate / size`` of the width and the partial outputs are summed over the ranks (unless
    ``reduce=False``: the MoE sums its routed and shared parts in one collective)."""

    def __init__(self, hidden: int, intermediate: int, shard: Shard = Shard(), reduce: bool = True):
        super().__init__()
        intermediate = shard.split(intermediate, "the MLP intermediate size")
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.shard = shard if reduce else Shard()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Router(nn.Module):
    """Group-limited top-k over sigmoid scores; returns (weights [T, k] fp32, experts [T, k] int32).
    ``backend``: as ``select_experts`` takes it (None: one Triton kernel on a GPU)."""

    def __init__(self, config: DeepseekV32Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        with torch.autocast(x.device.type, enabled=False):  # routing runs in fp32, also under training's autocast
            logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return select_experts(logits, self.e_score_correction_bias.float(), c.num_experts_per_tok, c.n_group,
                              c.topk_group, c.norm_topk_prob, c.routed_scaling_factor, backend=backend)


def expert_slices(num_experts: int, intermediate: int) -> dict[str, tuple[str, int, slice]]:
    """Checkpoint name suffix -> (stacked tensor, expert, row slice), e.g.
    ``"3.up_proj.weight" -> ("gate_up_proj", 3, slice(I, 2I))``; scales map to their block rows."""
    out = {}
    blocks = intermediate // GROUP
    for e in range(num_experts):
        for proj, rows, block_rows, stacked in (
            ("gate_proj", slice(0, intermediate), slice(0, blocks), "gate_up_proj"),
            ("up_proj", slice(intermediate, 2 * intermediate), slice(blocks, 2 * blocks), "gate_up_proj"),
            ("down_proj", slice(None), slice(None), "down_proj"),
        ):
            out[f"{e}.{proj}.weight"] = (stacked, e, rows)
            out[f"{e}.{proj}.weight{SCALE_SUFFIX}"] = (stacked + SCALE_SUFFIX, e, block_rows)
    return out


class Experts(nn.Module):
    """The routed experts, stacked: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` (+ e4m3 block scales)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, fp8: bool = False):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate, self.fp8 = num_experts, hidden, intermediate, fp8
        if fp8 and intermediate % GROUP:
            raise ValueError(f"FP8 experts need moe_intermediate_size a multiple of {GROUP}, got {intermediate}")
        dtype = E4M3 if fp8 else None
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype),
                                         requires_grad=not fp8)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype), requires_grad=not fp8)
        if fp8:
            g = lambda n: -(-n // GROUP)  # noqa: E731
            self.register_buffer("gate_up_proj" + SCALE_SUFFIX, torch.empty(num_experts, g(2 * intermediate), g(hidden)))
            self.register_buffer("down_proj" + SCALE_SUFFIX, torch.empty(num_experts, g(hidden), g(intermediate)))
        self.slices = expert_slices(num_experts, intermediate)
        self.register_state_dict_post_hook(_per_expert_state_dict)
        self.register_load_state_dict_pre_hook(_stack_expert_state_dict)

    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.fp8:
            return None, None
        return getattr(self, "gate_up_proj" + SCALE_SUFFIX), getattr(self, "down_proj" + SCALE_SUFFIX)


def _per_expert_state_dict(module: Experts, state: dict, prefix: str, _meta) -> None:
    """Replace the stacked tensors by the checkpoint's per-expert views."""
    stacked = {name: state.pop(prefix + name) for name in list(state_names(module))}
    for suffix, (name, e, rows) in module.slices.items():
        if name in stacked:
            state[prefix + suffix] = stacked[name][e, rows]


def _stack_expert_state_dict(module: Experts, state: dict, prefix: str, *_args) -> None:
    """Accept per-expert names (the checkpoint's) by stacking them into the module's tensors."""
    if not any(k.startswith(prefix) and k[len(prefix):] in module.slices for k in state):
        return
    stacked = {name: torch.empty_like(t, device=next(iter(state.values())).device)
               for name, t in state_names(module).items()}
    for suffix, (name, e, rows) in module.slices.items():
        if name in stacked and prefix + suffix in state:
            stacked[name][e, rows] = state.pop(prefix + suffix)
    state.update({prefix + name: t for name, t in stacked.items()})


def state_names(module: Experts) -> dict[str, torch.Tensor]:
    """The stacked tensors of ``module`` by name (weights, and scales when FP8)."""
    names = ["gate_up_proj", "down_proj"] + (["gate_up_proj" + SCALE_SUFFIX, "down_proj" + SCALE_SUFFIX] if module.fp8 else [])
    return {n: getattr(module, n) for n in names}


class MoE(nn.Module):
    """Routed experts plus the shared expert; ``x: [T, hidden]`` -> ``[T, hidden]``.

    Graph-capturable in production mode: no host sync. With autograd on (training) or in
    reference mode the experts run on the reference backend (differentiable torch code).

    Under tensor parallelism every rank routes all tokens (the router is replicated) and holds
    each expert's ``moe_intermediate_size / size`` slice, or, with expert parallelism, whole
    experts ``[first_expert, first_expert + E / size)``: ids of other ranks' experts fall outside
    the local stack and ``fused_moe`` skips them. Routed and shared partial sums are added and
    reduced over the ranks in one all-reduce."""

    def __init__(self, config: DeepseekV32Config, fp8_experts: bool = False, quantize_activations: bool = True,
                 pow2_scales: bool = False, shard: Shard = Shard()):
        super().__init__()
        self.gate = Router(config)
        experts, inter = config.n_routed_experts, config.moe_intermediate_size
        self.first_expert = 0
        if shard.expert_parallel:
            self.first_expert, stop = shard.range(experts, "n_routed_experts")
            experts = stop - self.first_expert
        else:
            inter = shard.split(inter, "moe_intermediate_size")
        self.experts = Experts(experts, config.hidden_size, inter, fp8_experts and inter % GROUP == 0)
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, shard,
                                  reduce=False)
        self.quantize_activations, self.pow2_scales, self.shard = quantize_activations, pow2_scales, shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        exact = torch.is_grad_enabled() or not self.quantize_activations  # training or reference mode: torch
        weights, experts = self.gate(x, backend="reference" if exact else None)  # [T, k] each
        if self.first_expert:
            experts = experts - self.first_expert  # other ranks' experts fall outside [0, local E)
        w13_scale, w2_scale = self.experts.scales()
        routed = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, experts, w13_scale,
                           w2_scale, pow2_scales=self.pow2_scales, quantize_activations=not exact,
                           backend="reference" if exact else None)
        return self.shard.all_reduce(routed + self.shared_experts(x))
