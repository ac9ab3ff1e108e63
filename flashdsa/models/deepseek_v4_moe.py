"""DeepSeek-V4's MoE: score-routed or hash-routed experts plus one shared expert, SwiGLU clipped.

Scores are ``sqrtsoftplus(x W_gate^T)`` (or sigmoid / softmax, per ``scoring_func``). A routed
layer picks the ``num_experts_per_tok`` best of ``score + e_score_correction_bias``; a hash layer
takes the experts ``tid2eid[token id]`` fixed at training. Either way the chosen experts' scores,
normalized to sum 1 and times ``routed_scaling_factor``, weight their outputs. Every expert (and
the shared one) computes ``down(silu(min(gate, L)) * clamp(up, -L, L))`` with ``L = swiglu_limit``.

Experts are stacked as transformers stores them: ``gate_up_proj [E, 2I, H]`` (gate rows, then up
rows) and ``down_proj [E, H, I]`` (or quantized: :class:`Experts`). Two ways to run the routed
experts (:class:`DeepseekV4MoE`): the fused path, ``runtime.moe.fused_moe`` (Triton grouped GEMMs
on a GPU, the clip in their epilogue, no host sync), and the reference loop (:meth:`Experts.forward`, each used expert on its
tokens in turn, a host sync per step; differentiable, for reference mode and fine-tuning).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdsa.models.deepseek_v4_config import DeepseekV4Config
from flashdsa.models.linear import SCALE_SUFFIX
from flashdsa.runtime.dense import dense_linear
from flashdsa.runtime.fp4 import FP4_GROUP
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP
from flashdsa.runtime.moe import fused_moe, hash_experts, select_experts, swiglu
from flashdsa.runtime.streams import branch


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)``: one kernel on a GPU without autograd (torch's ops under it)."""
    return swiglu(gate, up, limit, backend="reference" if torch.is_grad_enabled() else None)


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
        logits = dense_linear(x, self.weight.to(x.dtype))  # x's dtype: the routing widens it as it reads (no cast kernel)
        # one kernel on a GPU without autograd (hash: ~12 torch kernels, else ~10); torch's ops under it
        backend = "reference" if torch.is_grad_enabled() else None
        if self.hashed:
            return hash_experts(logits, self.tid2eid, input_ids, self.scale, scoring=self.scoring, backend=backend)
        return select_experts(logits, self.e_score_correction_bias, self.top_k, 1, 1, True, self.scale,
                              scoring=self.scoring, backend=backend)


class Experts(nn.Module):
    """The routed experts, stacked. With ``fp8`` (an FP8 checkpoint loaded for production) the
    weights stay e4m3 with fp32 scales per 128x128 block, ``gate_up_proj_scale_inv [E, 2I/128,
    ceil(H/128)]`` and ``down_proj_scale_inv [E, ceil(H/128), I/128]`` (activations quantized per
    token and 128 channels, power-of-two scales with ``pow2_scales``). With ``fp4_scales`` (a
    dtype: uint8 for UE8M0 exponent bytes, as the release stores them, or float32) they stay
    packed FP4 as DeepSeek ships V4 (``runtime.fp4``): ``gate_up_proj [E, 2I, H/2]`` and
    ``down_proj [E, H, I/2]`` uint8 with a scale per row and 32 inputs, ``gate_up_proj_scale_inv
    [E, 2I, H/32]`` and ``down_proj_scale_inv [E, H, I/32]`` (bf16 activations). Quantized
    experts run only through ``fused_moe``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, limit: float, fp8: bool = False,
                 pow2_scales: bool = False, fp4_scales: torch.dtype | None = None):
        super().__init__()
        if fp8 and intermediate % GROUP:
            raise ValueError(f"FP8 experts need moe_intermediate_size a multiple of {GROUP}, got {intermediate}")
        if fp4_scales is not None and (hidden % FP4_GROUP or intermediate % FP4_GROUP):
            raise ValueError(f"FP4 experts need hidden_size and moe_intermediate_size multiples of {FP4_GROUP}, "
                             f"got {hidden} and {intermediate}")
        self.limit, self.fp8, self.pow2_scales, self.fp4 = limit, fp8, pow2_scales, fp4_scales is not None
        self.quantized = self.fp8 or self.fp4
        dtype, packing = (E4M3, 1) if fp8 else (torch.uint8, 2) if self.fp4 else (None, 1)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden // packing, dtype=dtype),
                                         requires_grad=not self.quantized)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate // packing, dtype=dtype),
                                      requires_grad=not self.quantized)
        if fp8:
            blocks, inter_blocks = -(-hidden // GROUP), intermediate // GROUP
            self.register_buffer("gate_up_proj" + SCALE_SUFFIX, torch.empty(num_experts, 2 * inter_blocks, blocks))
            self.register_buffer("down_proj" + SCALE_SUFFIX, torch.empty(num_experts, blocks, inter_blocks))
        if self.fp4:
            self.register_buffer("gate_up_proj" + SCALE_SUFFIX, torch.empty(
                num_experts, 2 * intermediate, hidden // FP4_GROUP, dtype=fp4_scales))
            self.register_buffer("down_proj" + SCALE_SUFFIX, torch.empty(
                num_experts, hidden, intermediate // FP4_GROUP, dtype=fp4_scales))

    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.quantized:
            return None, None
        return getattr(self, "gate_up_proj" + SCALE_SUFFIX), getattr(self, "down_proj" + SCALE_SUFFIX)

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
    activations with autograd off (production mode, whose weights are bf16 or FP8) run the routed
    experts through ``fused_moe``, graph-capturable (no host sync); anything else (fp32 reference
    mode, or autograd on: fine-tuning) runs the differentiable reference loop. A bf16 model in
    reference mode therefore takes the fused path too: it computes the same function, in fp32
    accumulation. Quantized (FP8 or FP4) experts outside the fused path run ``fused_moe``'s
    reference backend on the weights dequantized per expert (differentiable in x)."""

    def __init__(self, config: DeepseekV4Config, hashed: bool):
        super().__init__()
        c = config
        self.gate = Router(c, hashed)
        self.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.swiglu_limit)
        self.shared_experts = SharedExpert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x: [T, H]``, ``input_ids: [T]`` (hash routing reads them) -> ``[T, H]``."""
        routed, shared = self.parts(x, input_ids)
        return routed + shared

    def parts(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' and the shared expert's outputs ``[T, H]`` each, unsummed: the decoder
        layer's mHC adds them in its own kernel (``HyperConnection.expand``'s ``extra``)."""
        side = branch(x)  # in a captured decode step the shared expert runs beside the routed ones
        with side.run():
            shared = self.shared_experts(x)
        weights, experts = self.gate(x, input_ids)
        fused = x.dtype == torch.bfloat16 and not torch.is_grad_enabled()
        if fused or self.experts.quantized:
            e = self.experts
            routed = fused_moe(x, e.gate_up_proj, e.down_proj, weights, experts, *e.scales(), pow2_scales=e.pow2_scales,
                               quantize_activations=fused, swiglu_limit=e.limit, backend=None if fused else "reference")
        else:
            routed = self.experts(x, weights, experts)
        side.join()
        return routed, shared
