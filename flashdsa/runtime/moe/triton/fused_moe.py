"""Routed experts in Triton with no host sync: align, gate/up GEMM + SiLU, down GEMM, combine.

Launches per call: the alignment (1, or 2 past 1024 pairs), the gate/up grouped GEMM with
``silu(gate) * up`` in its epilogue (gate and up clipped first under a ``swiglu_limit``), the
down grouped GEMM scaling each pair by its routing weight, and the combine (the fp32 sum of each
token's k pair rows); FP8 weights add the activation quantizer
(``runtime.gemm.quantize_activations``) before each GEMM; FP4 weights (packed e2m1, ``runtime.fp4``)
are unpacked to bf16 inside the GEMMs' K loops, the activations staying bf16. Every buffer size follows from
the shapes (the alignment's static block bound), so the call can be captured in a CUDA graph.
Past ``CHUNK_TOKENS`` tokens the call runs chunk by chunk, so its buffers stay bounded.

The launch shape comes from :func:`choose_config`, by the mean number of pairs per expert: at
decode (a few pairs per expert) the GEMMs stream each chosen expert's weights once, 16-row
blocks and narrow column tiles spreading them over many programs; at prefill bigger tiles reuse
them. ``benchmarks/bench_moe.py --sweep`` measures the candidates that fix this table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from flashdsa.runtime.gemm import quantize_activations
from flashdsa.runtime.moe.alignment import max_blocks
from flashdsa.runtime.moe.triton.align import align_tokens
from flashdsa.runtime.moe.triton.grouped_gemm import Tile, grouped_gemm

COMBINE_BLOCK = 1024  # hidden columns per combine program
CHUNK_TOKENS = 8192  # tokens per pass: bounds the pair outputs [T*k, H] (940 MB bf16 at V3.2 widths)


@dataclass(frozen=True)
class MoeConfig:
    """Rows per aligned block (a power of two >= 16) and the two GEMMs' tiles."""

    block_m: int
    gate_up: Tile
    down: Tile


WEIGHT_FORMATS = ("bf16", "fp8", "fp4")  # the expert weights' storage, the HEURISTIC's columns

# (largest mean pairs per expert, bf16 config, FP8 config, FP4 config): the first row whose bound
# holds. FP8 tiles keep block_k dividing 128 (one scale per step), FP4 tiles a multiple of 32 (whole
# scale groups). The FP4 decode rows (<= 16 pairs an expert) are the fastest of
# `bench_moe.py --sweep --shape v4 --dtype fp4` on an H200 (session 7, the tl.dot_scaled path, T = 1,
# 32, 128); the FP8 prefill row (> 48 pairs an expert) is the fastest at T = 4096 and 16384 on an
# H200 (session 21: its down GEMM at 4 warps, 2.2 / 7.5 ms against 3.4 / 10.1 at 8); the other rows
# were written without a GPU run (each fits Hopper's shared memory with its pipeline stages):
# `bench_moe.py --sweep` is what fixes them.
HEURISTIC: tuple[tuple[float, MoeConfig, MoeConfig, MoeConfig], ...] = (
    (2, MoeConfig(16, Tile(32, 128, 4, 4), Tile(64, 128, 4, 4)),
     MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
     MoeConfig(16, Tile(64, 128, 4, 3), Tile(64, 128, 4, 5))),
    (16, MoeConfig(16, Tile(64, 64, 4, 4), Tile(64, 64, 4, 4)),
     MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
     MoeConfig(16, Tile(64, 64, 4, 4), Tile(64, 128, 4, 4))),
    (48, MoeConfig(32, Tile(64, 64, 4, 4), Tile(128, 64, 4, 4)),
     MoeConfig(32, Tile(64, 128, 4, 3), Tile(128, 128, 4, 3)),
     MoeConfig(32, Tile(64, 128, 4, 3), Tile(128, 64, 4, 3))),
    (math.inf, MoeConfig(64, Tile(128, 64, 8, 3), Tile(128, 64, 4, 4)),
     MoeConfig(64, Tile(128, 128, 8, 3), Tile(128, 128, 4, 3)),
     MoeConfig(64, Tile(128, 64, 8, 3), Tile(128, 64, 8, 3))),
)


def weight_format(w13: torch.Tensor) -> str:
    """Which of WEIGHT_FORMATS the stacked expert weight ``w13`` is stored in."""
    return {torch.float8_e4m3fn: "fp8", torch.uint8: "fp4"}.get(w13.dtype, "bf16")


def choose_config(num_pairs: int, num_experts: int, weights: str) -> MoeConfig:
    """The launch shape for ``num_pairs`` (token, slot) pairs over ``num_experts`` experts whose
    weights are stored as ``weights`` (one of WEIGHT_FORMATS)."""
    per_expert = num_pairs / num_experts
    column = 1 + WEIGHT_FORMATS.index(weights)
    for row in HEURISTIC:
        if per_expert <= row[0]:
            return row[column]
    raise AssertionError("the last HEURISTIC row has no bound")


@triton.jit
def _combine_kernel(pair_out_ptr, expert_ids_ptr, out_ptr, hidden, num_experts, top_k, BLOCK_H: tl.constexpr):
    """out[t] = fp32 sum of the rows of token t's valid pairs (pair rows of invalid ones are never read)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(top_k):
        pair = token * top_k + j
        expert = tl.load(expert_ids_ptr + pair)
        valid = (expert >= 0) & (expert < num_experts)
        acc += tl.load(pair_out_ptr + pair * hidden + cols, mask=col_ok & valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              expert_ids: torch.Tensor, w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor],
              pow2_scales: bool, quantize: bool, out: Optional[torch.Tensor], *,
              swiglu_limit: Optional[float] = None, config: Optional[MoeConfig] = None,
              chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """The public ``fused_moe`` (arguments checked there; FP8 weights only with ``quantize``; FP4
    weights uint8 with uint8 or fp32 scales), run
    ``chunk_tokens`` tokens at a time; ``config`` overrides :func:`choose_config` (benchmark sweeps)."""
    out = torch.empty_like(x) if out is None else out
    for start in range(0, x.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        _routed_experts(x[rows], w13, w2, weights[rows], expert_ids[rows], w13_scale, w2_scale, pow2_scales,
                        out[rows], config, swiglu_limit)
    return out


def _routed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    expert_ids: torch.Tensor, w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor],
                    pow2_scales: bool, out: torch.Tensor, config: Optional[MoeConfig],
                    swiglu_limit: Optional[float]) -> None:
    """One chunk of tokens into ``out``: x, weights, expert_ids and out are row slices (contiguous)."""
    tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    weights_format = weight_format(w13)
    fp8 = weights_format == "fp8"
    config = config or choose_config(tokens * top_k, num_experts, weights_format)
    num_blocks = max_blocks(tokens * top_k, num_experts, config.block_m)
    aligned = align_tokens(expert_ids, num_experts, config.block_m, num_blocks)
    a, a_scale = quantize_activations(x, pow2_scales=pow2_scales) if fp8 else (x, None)
    h = torch.empty(num_blocks * config.block_m, inter, dtype=x.dtype, device=x.device)  # aligned rows
    grouped_gemm(a, a_scale, w13, w13_scale, h, aligned, top_k, config.gate_up, gated=True,
                 swiglu_limit=swiglu_limit)
    h, h_scale = quantize_activations(h, pow2_scales=pow2_scales) if fp8 else (h, None)
    pair_out = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(h, h_scale, w2, w2_scale, pair_out, aligned, top_k, config.down, gated=False,
                 route_weights=weights.view(-1))
    combine_pairs(pair_out, expert_ids, num_experts, out)


def combine_pairs(pair_out: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, out: torch.Tensor) -> None:
    """out[t] = fp32 sum of pair_out's rows ``t * top_k + j`` of token t's valid experts (ids in [0, E))."""
    tokens, top_k = expert_ids.shape
    hidden = out.shape[1]
    grid = (tokens, triton.cdiv(hidden, COMBINE_BLOCK))
    _combine_kernel[grid](pair_out, expert_ids, out, hidden, num_experts, top_k, BLOCK_H=COMBINE_BLOCK, num_warps=4)
