"""Routed experts of DeepSeek's MoE with no host sync: routing, alignment by expert, grouped GEMMs.

For T tokens, each routed to top_k of E experts (hidden H, intermediate I)::

    router_logits [T, E] --select_experts--> weights [T, k] fp32, expert_ids [T, k] int32
    (DeepSeek-V4's hash layers: router_logits, tid2eid [V, k], token ids [T] --hash_experts--> the same)
    fused_moe: out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = expert_ids[t, j]

(DeepSeek-V4 clips the SwiGLU: ``silu(min(gate, L)) * clamp(up, -L, L)``, fused_moe's ``swiglu_limit``;
``swiglu`` is that activation alone, for the shared expert, whose GEMMs are plain linear layers.)

A (token, slot) pair is the flat index ``p = t * top_k + j``. An expert id < 0 or >= E (under
expert parallelism: an expert another rank owns) contributes nothing and is never dereferenced.
On the triton backend nothing reads a device value back to the host and every size depends only
on the input shapes, so a decode step built on these ops can be captured in a CUDA graph.

Backends (see ``flashdsa.runtime.dispatch``): ``reference`` (torch, any device; loops over the
experts, one sync each on CUDA) and ``triton`` (bf16 activations; bf16 weights, FP8 e4m3 weights
with 128x128 block scales, or FP4 e2m1 weights packed two a byte with a power-of-two scale per 32
inputs, DeepSeek-V4's release format; E <= 1024; routing: one kernel a token, E <= 4096, top_k <= 64;
swiglu: one elementwise kernel), and for ``fused_moe`` ``cuda`` (SM90: FP4 experts with UE8M0 scales
at decode sizes, up to CUDA_MAX_PAIRS_PER_EXPERT pairs an expert on average, H and I multiples of
128; it quantizes the activations and the intermediate to e4m3, W4A8 as DeepGEMM's and SGLang's
Hopper FP4 paths do, where triton multiplies bf16 activations; it declines other calls, which run
on triton). Registered targets: ``{align_tokens, fused_moe, select_experts, hash_experts, swiglu}``
-> ``flashdsa.runtime.moe.reference:<op>`` and ``flashdsa.runtime.moe.triton.<module>:<op>``
(modules ``align``, ``fused_moe``, ``routing`` for both routings, ``swiglu``);
``fused_moe`` -> ``flashdsa.runtime.moe.cuda.fused_moe:fused_moe``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from flashdsa.runtime import dispatch, native
from flashdsa.runtime.checks import check, check_tensor, describe
from flashdsa.runtime.fp4 import FP4_GROUP
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.moe.alignment import AlignedPairs, max_blocks

__all__ = ["AlignedPairs", "align_tokens", "fused_moe", "hash_experts", "max_blocks", "select_experts", "swiglu"]

SCALE_GROUP = 128  # rows and columns per FP8 weight-scale block
TRITON_MAX_EXPERTS = 1024  # the triton alignment holds one counter per expert in registers
TRITON_MAX_ROUTED, TRITON_MAX_TOP_K = 4096, 64  # a routing row in registers; top_k unrolled rounds
ACTIVATION_DTYPES = (torch.bfloat16, torch.float32, torch.float64)  # fp32/fp64: reference only (fp64: gradchecks)
FP4_DTYPES = (torch.uint8, torch.int8)  # packed e2m1 pairs (int8 as DeepSeek stores them, read as bytes)
FP4_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu, torch.float32)  # UE8M0 (exponent byte or e8m0) or fp32


def _triton_supports(num_experts: int, dtype: torch.dtype = torch.bfloat16, dequantized_fp8: bool = False,
                     **_) -> Optional[str]:
    if num_experts > TRITON_MAX_EXPERTS:
        return f"triton MoE handles at most {TRITON_MAX_EXPERTS} experts, got {num_experts}"
    if dtype != torch.bfloat16:
        return f"triton MoE takes bf16 activations, got {dtype}"
    if dequantized_fp8:
        return "triton MoE runs FP8 weights on quantized activations only (quantize_activations=False)"
    return None


CUDA_MAX_PAIRS_PER_EXPERT = 16  # decode sizes: past this mean, Triton's bigger tiles reuse the weights
CUDA_CHUNK = 128  # inputs per step of the native FP4 kernels (H and I multiples of it)


def _cuda_supports(num_experts: int, dtype: torch.dtype = torch.bfloat16, fp4_ue8m0: bool = False,
                   pairs_per_expert: float = 0.0, hidden: int = 0, inter: int = 0, **_) -> Optional[str]:
    if not fp4_ue8m0:
        return dispatch.Declined("cuda fused_moe holds the FP4 (UE8M0-scaled) experts; triton runs the others")
    if pairs_per_expert > CUDA_MAX_PAIRS_PER_EXPERT:
        return dispatch.Declined(f"{pairs_per_expert:.0f} pairs an expert: triton's bigger tiles reuse the weights")
    reason = _triton_supports(num_experts, dtype)  # the alignment and the combine are triton's kernels
    if reason is None and (hidden % CUDA_CHUNK or inter % CUDA_CHUNK):
        reason = f"cuda fused_moe needs H and I multiples of {CUDA_CHUNK}, got H={hidden}, I={inter}"
    return reason or native.unavailable()


SCORINGS = ("sigmoid", "sqrtsoftplus", "softmax")  # DeepSeek-V3's, and V4's scoring_func choices
TRITON_SCORINGS = ("sigmoid", "sqrtsoftplus")
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # router logits; 16-bit ones widened as read
SWIGLU_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # fp64: reference only (gradchecks)
TRITON_SWIGLU_DTYPES = SWIGLU_DTYPES[:3]


def _triton_routes(padded_experts: int, top_k: int, scoring: str = "sigmoid", **_) -> Optional[str]:
    if scoring not in TRITON_SCORINGS:
        return f"triton routing scores with {' or '.join(TRITON_SCORINGS)}, got {scoring}"
    if padded_experts > TRITON_MAX_ROUTED:
        return f"triton routing holds at most {TRITON_MAX_ROUTED} (power-of-two padded) experts a row, got {padded_experts}"
    return None if top_k <= TRITON_MAX_TOP_K else f"triton routing takes top_k <= {TRITON_MAX_TOP_K}, got {top_k}"


def _triton_hash_routes(top_k: int, scoring: str, **_) -> Optional[str]:
    return _triton_routes(1, top_k, scoring)  # the kernel holds a token's top_k logits, not its row


def _triton_activates(dtype: torch.dtype, **_) -> Optional[str]:
    return None if dtype in TRITON_SWIGLU_DTYPES else f"triton swiglu takes bf16/fp16/fp32, got {dtype}"


for _op, _module, _supports in (("align_tokens", "align", _triton_supports), ("fused_moe", "fused_moe", _triton_supports),
                                ("select_experts", "routing", _triton_routes), ("hash_experts", "routing", _triton_hash_routes),
                                ("swiglu", "swiglu", _triton_activates)):
    dispatch.register(_op, "reference", f"{__name__}.reference:{_op}")
    dispatch.register(_op, "triton", f"{__name__}.triton.{_module}:{_op}", _supports)
dispatch.register("fused_moe", "cuda", f"{__name__}.cuda.fused_moe:fused_moe", _cuda_supports)


def _check_int(name: str, value: object, low: int, high: Optional[int] = None) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    check(ok, f"{name} must be an int in [{low}, {'inf' if high is None else high}], got {value!r}")
    return value


def select_experts(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                   norm_topk_prob: bool, routed_scaling_factor: float, *, scoring: str = "sigmoid",
                   backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 group-limited routing over sigmoid scores (or DeepSeek-V4's ``scoring``:
    ``sqrtsoftplus`` = sqrt(softplus(logits)), or ``softmax`` over the row), on the device with no sync.

    router_logits: [T, E] fp32 (``x @ W_gate^T``; bf16/fp16 are widened exactly as they are read, so a
    bf16 GEMM's output needs no cast); bias: [E] fp32 (bf16/fp16 widened),
    ``e_score_correction_bias``.
    Scores ``s = sigmoid(logits)``; the choice ranks ``s + bias``: the ``topk_group`` of the
    ``n_group`` equal groups with the largest sum of their two best are kept, then the ``top_k``
    best experts inside them. Their uncorrected scores, divided by their sum (+1e-20) when
    ``norm_topk_prob``, times ``routed_scaling_factor``, are the weights.
    Returns (weights [T, top_k] fp32, expert_ids [T, top_k] int32), by descending ``s + bias``;
    equal values (of experts and of groups) go to the lower index. NaN logits route arbitrarily
    (never outside [0, E)). The triton backend is one kernel a token (the reference ~15 torch
    kernels): the same experts, the weights within an ulp (the chosen scores summed in another order).
    """
    check_tensor("router_logits", router_logits, LOGIT_DTYPES, [None, None], "fp32 (or bf16/fp16) [T, E]")
    num_experts = router_logits.shape[1]
    check_tensor("bias", bias, (torch.float32, torch.bfloat16, torch.float16), [num_experts],
                 f"fp32 (or bf16/fp16) [E={num_experts}]", router_logits.device)
    _check_int("n_group", n_group, 1, max(num_experts, 1))
    check(num_experts % n_group == 0, f"n_group ({n_group}) must divide the number of experts ({num_experts})")
    _check_int("topk_group", topk_group, 1, n_group)
    per_group = num_experts // n_group
    _check_int("top_k", top_k, 1, topk_group * per_group)
    check(topk_group == n_group or per_group >= 2,
          f"group-limited routing ranks groups by their two best experts: groups of {per_group} are too small")
    check(isinstance(norm_topk_prob, bool), f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
    factor = _check_factor(routed_scaling_factor)
    check(scoring in SCORINGS, f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    padded = (1 << (n_group - 1).bit_length()) * (1 << (per_group - 1).bit_length())
    impl = dispatch.select("select_experts", router_logits.device, backend, padded_experts=padded, top_k=top_k,
                           scoring=scoring)
    return impl(router_logits, bias.float(), top_k, n_group, topk_group, norm_topk_prob, factor, scoring)


def _check_factor(routed_scaling_factor: object) -> float:
    is_number = isinstance(routed_scaling_factor, (int, float)) and not isinstance(routed_scaling_factor, bool)
    check(is_number and math.isfinite(routed_scaling_factor),
          f"routed_scaling_factor must be a finite number, got {routed_scaling_factor!r}")
    return float(routed_scaling_factor)


def hash_experts(router_logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor,
                 routed_scaling_factor: float, *, scoring: str = "sqrtsoftplus",
                 backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's hash routing: each token takes the ``top_k`` experts its id's row of a table
    fixed at training gives, weighted by their scores normalized to sum 1, on the device with no sync.

    router_logits: [T, E] fp32 or bf16/fp16 (``x @ W_gate^T``; rows may be strided; widened exactly as
    :func:`select_experts` does); tid2eid: [V, top_k] int64
    or int32, the experts of each token id; input_ids: [T] int64 or int32 token ids.
    Scores ``s = scoring(logits)`` (``sqrtsoftplus``, ``sigmoid`` or ``softmax`` over the row, as
    :func:`select_experts`); the weights are the chosen experts' ``s``, divided by their sum
    (+1e-20), times ``routed_scaling_factor``. Returns (weights [T, top_k] fp32, expert_ids
    [T, top_k] int32) in the table's order. A table entry outside [0, E), and every entry of a
    token id outside [0, V), comes out as id -1 with weight 0 (``fused_moe`` skips it; nothing
    outside the tensors is read). The triton backend is one kernel a token reading only its
    ``top_k`` logits (softmax needs the whole row: reference only): the same experts, the
    weights within an ulp (the chosen scores summed in another order).
    """
    check_tensor("router_logits", router_logits, LOGIT_DTYPES, [None, None], "fp32 (or bf16/fp16) [T, E]",
                 contiguous=False)
    tokens, num_experts = router_logits.shape
    check(router_logits.stride(1) == 1, f"router_logits must have contiguous rows, got strides {router_logits.stride()}")
    device = router_logits.device
    check_tensor("tid2eid", tid2eid, (torch.int64, torch.int32), [None, None], "int64/int32 [V, top_k]", device)
    vocab, top_k = tid2eid.shape
    check(vocab >= 1 and top_k >= 1, f"tid2eid must be int64/int32 [V >= 1, top_k >= 1], got {describe(tid2eid)}")
    check_tensor("input_ids", input_ids, (torch.int64, torch.int32), [tokens], f"int64/int32 [T={tokens}]", device)
    factor = _check_factor(routed_scaling_factor)
    check(scoring in SCORINGS, f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    impl = dispatch.select("hash_experts", device, backend, top_k=top_k, scoring=scoring)
    return impl(router_logits, tid2eid, input_ids, factor, scoring)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: Optional[float] = None, *,
           backend: Optional[str] = None) -> torch.Tensor:
    """The gated activation of a SwiGLU MLP, ``silu(gate) * up``; with ``limit`` L (a number > 0)
    DeepSeek-V4's clipped form ``silu(min(gate, L)) * clamp(up, -L, L)``.

    gate, up: [T, I] of one dtype, bf16/fp16/fp32 (fp64: reference only), each row contiguous but
    the rows may be strided (the two halves of a fused gate|up GEMM's ``[T, 2I]`` output, read in
    place). Returns [T, I] contiguous in that dtype, computed as torch's clamp, silu and product
    (each rounded to the dtype; L too). The triton backend is one kernel (torch's: four with the
    clip), equal to torch's on a GPU; it does not record autograd, so a caller that needs gradients
    forces ``backend="reference"``.
    """
    check_tensor("gate", gate, SWIGLU_DTYPES, [None, None], "bf16/fp16/fp32/fp64 [T, I]", contiguous=False)
    check_tensor("up", up, gate.dtype, list(gate.shape), f"{_name(gate.dtype)} {list(gate.shape)} like gate",
                 gate.device, contiguous=False)
    for name, t in (("gate", gate), ("up", up)):
        check(t.stride(1) == 1 or t.shape[1] <= 1, f"{name} must have contiguous rows, got strides {t.stride()}")
    if limit is not None:
        is_number = isinstance(limit, (int, float)) and not isinstance(limit, bool)
        check(is_number and limit > 0, f"limit must be a number > 0 (inf: no clip) or None, got {limit!r}")
        limit = float(limit)
    impl = dispatch.select("swiglu", gate.device, backend, dtype=gate.dtype)
    return impl(gate, up, limit)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_expert_ids(expert_ids: object, tokens: Optional[int] = None,
                      device: Optional[torch.device] = None) -> tuple[int, int]:
    expected = f"int32 [T{'' if tokens is None else f'={tokens}'}, top_k >= 1]"
    check_tensor("expert_ids", expert_ids, torch.int32, [tokens, None], expected, device)
    check(expert_ids.shape[1] >= 1, f"expert_ids must be {expected}, got {describe(expert_ids)}")
    return expert_ids.shape


def align_tokens(expert_ids: torch.Tensor, num_experts: int, block_m: int, *,
                 backend: Optional[str] = None) -> AlignedPairs:
    """Sort the (token, slot) pairs by expert into ``block_m``-row blocks of one expert each.

    expert_ids: [T, top_k] int32; num_experts: E >= 1; block_m: a power of two in [1, 256].
    Returns :class:`AlignedPairs`: sorted_pairs [max_blocks(T*k, E, block_m) * block_m] int32 holds,
    for expert 0, 1, ... in turn, its pairs in ascending order, padded with -1 to whole blocks;
    block_experts [max_blocks] int32 the expert of each block. Blocks past the used ones have
    expert -1 and rows -1. Pairs whose expert is < 0 or >= E appear nowhere.
    """
    tokens, top_k = _check_expert_ids(expert_ids)
    _check_int("num_experts", num_experts, 1)
    _check_int("block_m", block_m, 1, 256)
    check(block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}")
    num_blocks = max_blocks(tokens * top_k, num_experts, block_m)
    impl = dispatch.select("align_tokens", expert_ids.device, backend, num_experts=num_experts)
    return impl(expert_ids, num_experts, block_m, num_blocks)


def _check_weights(x, w13, w2, w13_scale, w2_scale) -> None:
    """w13: [E, 2I, H], w2: [E, H, I], both x's dtype, or both e4m3 with their block scales, or
    both packed FP4 (``[E, 2I, H/2]``, ``[E, H, I/2]``) with a scale per row and 32 inputs."""
    hidden, device = x.shape[1], x.device
    fp4 = isinstance(w13, torch.Tensor) and w13.dtype in FP4_DTYPES
    if fp4:
        check(hidden % FP4_GROUP == 0, f"FP4 experts need H a multiple of {FP4_GROUP}, got x {list(x.shape)}")
    packing = 2 if fp4 else 1  # inputs a stored element
    check_tensor("w13", w13, (x.dtype, E4M3, *FP4_DTYPES), [None, None, hidden // packing],
                 f"{_name(x.dtype)} or e4m3 [E, 2*I, H={hidden}] or packed FP4 uint8/int8 [E, 2*I, H/2]", device)
    num_experts, two_inter = w13.shape[:2]
    check(num_experts >= 1 and two_inter >= 2 and two_inter % 2 == 0,
          f"w13 must stack gate and up rows [E >= 1, 2*I >= 2, H], got {list(w13.shape)}")
    inter = two_inter // 2
    check(not fp4 or inter % FP4_GROUP == 0, f"FP4 experts need I a multiple of {FP4_GROUP}, got w13 {list(w13.shape)}")
    check_tensor("w2", w2, w13.dtype, [num_experts, hidden, inter // packing],
                 f"{_name(w13.dtype)} [E={num_experts}, H={hidden}, I{'/2' if fp4 else ''}={inter // packing}] "
                 "like w13", device)
    for name, scale, rows, cols in (("w13_scale", w13_scale, two_inter, hidden), ("w2_scale", w2_scale, hidden, inter)):
        if fp4:
            shape = [num_experts, rows, cols // FP4_GROUP]
            check_tensor(name, scale, FP4_SCALE_DTYPES, shape,
                         f"uint8/float8_e8m0fnu (UE8M0) or fp32 {shape} (one scale per row and 32 inputs)", device)
        elif w13.dtype == E4M3:
            shape = [num_experts, -(-rows // SCALE_GROUP), -(-cols // SCALE_GROUP)]
            check_tensor(name, scale, torch.float32, shape, f"fp32 {shape} (one scale per 128x128 block)", device)
        else:
            check(scale is None,
                  f"{name} must be None for {_name(w13.dtype)} weights (only FP8/FP4 weights have scales)")
    if fp4:
        check(w13_scale.dtype == w2_scale.dtype, f"w2_scale must have w13_scale's dtype {_name(w13_scale.dtype)}, "
                                                 f"got {describe(w2_scale)}")


def _as_bytes(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A packed FP4 weight (int8) or a UE8M0 scale (float8_e8m0fnu) as the uint8 bytes the kernels read."""
    return t.view(torch.uint8) if t is not None and t.dtype in (torch.int8, torch.float8_e8m0fnu) else t


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
              w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
              pow2_scales: bool = False, quantize_activations: bool = True, *,
              swiglu_limit: Optional[float] = None, out: Optional[torch.Tensor] = None,
              backend: Optional[str] = None) -> torch.Tensor:
    """Routed experts of T tokens: ``out[t] = sum_j weights[t, j] * y(t, expert_ids[t, j])`` with
    ``y(t, e) = w2[e] @ (silu(gate) * up)`` and ``[gate; up] = w13[e] @ x[t]``; with
    ``swiglu_limit`` L (a finite number > 0, DeepSeek-V4's clipped SwiGLU) the fp32 products are
    clipped first: ``silu(min(gate, L)) * clamp(up, -L, L)``.

    x: [T, H] bf16 (fp32: reference backend only). w13: [E, 2*I, H], gate rows then up rows;
    w2: [E, H, I]; both x's dtype, or both float8_e4m3fn with w13_scale [E, ceil(2I/128),
    ceil(H/128)] and w2_scale [E, ceil(H/128), ceil(I/128)] fp32 (``w ~= w_fp8 * scale`` per
    128x128 block), or both packed FP4 (``runtime.fp4``: e2m1 pairs, low nibble first) uint8/int8
    w13 [E, 2*I, H/2], w2 [E, H, I/2] with w13_scale [E, 2*I, H/32] and w2_scale [E, H, I/32]
    UE8M0 (uint8 exponent bytes or float8_e8m0fnu) or fp32 (H and I multiples of 32); FP4 weights
    are dequantized to x's dtype in the GEMMs and multiply unquantized activations (the cuda
    backend instead quantizes the activations per token and 128 channels and the intermediate per
    32 channels to e4m3, and multiplies them with the weights turned into e4m3 exactly). With FP8
    weights the activations are quantized per token and 128 channels by
    ``runtime.gemm.quantize_activations`` (power-of-two scales with ``pow2_scales``); with
    ``quantize_activations=False`` (reference backend only) the weights are dequantized instead
    and multiplied in fp32, as a dequantized checkpoint would be. Both flags are ignored for bf16
    and FP4 weights. weights: [T, top_k] fp32; expert_ids: [T, top_k] int32, ids outside [0, E)
    skipped.
    out: optional [T, H] buffer of x's dtype to write (a CUDA graph's static output).
    Products accumulate in fp32; the intermediate ``silu(gate) * up`` and each pair's weighted
    output are rounded to x's dtype; the sum over the k pairs is fp32. Returns out [T, H].
    """
    check_tensor("x", x, ACTIVATION_DTYPES, [None, None], "bf16/fp32/fp64 [T, H]")
    tokens, hidden = x.shape
    check(hidden >= 1, f"x must have H >= 1, got {list(x.shape)}")
    _check_weights(x, w13, w2, w13_scale, w2_scale)
    _, top_k = _check_expert_ids(expert_ids, tokens, x.device)
    check_tensor("weights", weights, torch.float32, [tokens, top_k], f"fp32 [T={tokens}, top_k={top_k}]", x.device)
    for name, flag in (("pow2_scales", pow2_scales), ("quantize_activations", quantize_activations)):
        check(isinstance(flag, bool), f"{name} must be a bool, got {flag!r}")
    if swiglu_limit is not None:
        is_number = isinstance(swiglu_limit, (int, float)) and not isinstance(swiglu_limit, bool)
        check(is_number and math.isfinite(swiglu_limit) and swiglu_limit > 0,
              f"swiglu_limit must be a finite number > 0 or None, got {swiglu_limit!r}")
        swiglu_limit = float(swiglu_limit)
    if out is not None:
        check_tensor("out", out, x.dtype, [tokens, hidden], f"{_name(x.dtype)} [T={tokens}, H={hidden}]",
                     x.device)
    dequantized_fp8 = w13.dtype == E4M3 and not quantize_activations
    fp4_ue8m0 = w13.dtype in FP4_DTYPES and w13_scale.dtype != torch.float32
    impl = dispatch.select("fused_moe", x.device, backend, num_experts=w13.shape[0], dtype=x.dtype,
                           dequantized_fp8=dequantized_fp8, fp4_ue8m0=fp4_ue8m0,
                           pairs_per_expert=tokens * top_k / w13.shape[0], hidden=hidden, inter=w13.shape[1] // 2)
    w13, w2, w13_scale, w2_scale = (_as_bytes(t) for t in (w13, w2, w13_scale, w2_scale))
    return impl(x, w13, w2, weights, expert_ids, w13_scale, w2_scale, pow2_scales, quantize_activations, out,
                swiglu_limit=swiglu_limit)
