"""Native W4A8 FP4 experts (``moe/cuda/fp4_moe.cu``) against a float64 restatement of their math.

The kernels quantize the activations (per token and 128 channels) and the intermediate (per row
and 32 channels) to e4m3 and take the weights' e2m1 values exactly, so the restatement does the
same in float64 from the public quantizer's bytes: the two differ by summation order, which can
flip an e4m3 rounding of the intermediate (FP8 tolerance). Against the bf16-activation reference
the difference is the activation quantization itself: a looser bound, which a kernel that dropped
a scale group or a token would still fail by far. Outputs start poisoned (NaN ``out``, the
allocator flooded with NaN). GPU tests are marked ``gpu``; the dispatch tests run on the CPU.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.moe import _cuda_supports, fused_moe
from flashdsa.testing import cosine_distance, flood_cuda_allocator_with_nan, kernel_test_main, poisoned
from moe_cases import (SEED, assert_moe_close, assert_sync_free_and_replayable, generator, moe_inputs,
                       with_fp4_weights)

cuda = torch.device("cuda")
V4 = dict(top_k=6, hidden=4096, inter=2048)  # DeepSeek-V4-Flash's expert widths


def e4m3_round_trip(v: torch.Tensor, group: int, scale_floor: float = 1e-4) -> torch.Tensor:
    """v [rows, K] float64 quantized per row and ``group`` columns as the kernels' intermediate is
    (scale amax / 448, amax at least ``scale_floor``), then dequantized."""
    rows, k = v.shape
    groups = v.view(rows, k // group, group)
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(scale_floor) / 448
    return ((groups / scale).float().to(torch.float8_e4m3fn).double() * scale).view(rows, k)


def w4a8_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
             w13_scale: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """The native path's math in float64, expert by expert on x's device: e4m3 activations (the
    public quantizer's bytes), exact FP4 weights, the intermediate through e4m3 per 32 channels,
    each pair's output rounded to bf16, the pairs of a token summed."""
    from flashdsa.runtime.fp4 import dequantize_fp4
    from flashdsa.runtime.gemm import quantize_activations

    tokens, top_k = expert_ids.shape
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    if tokens == 0:
        return out.to(torch.bfloat16)
    a, a_scale = quantize_activations(x)
    a = (a.double().view(tokens, -1, 128) * a_scale.double()[..., None]).view(x.shape)
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        token, slot = (expert_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = (a[token] @ dequantize_fp4(w13[e], w13_scale[e]).double().T).split(inter, dim=1)
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        h = e4m3_round_trip(torch.nn.functional.silu(gate) * up, 32)
        y = weights[token, slot].double()[:, None] * (h @ dequantize_fp4(w2[e], w2_scale[e]).double().T)
        out.index_add_(0, token, y.to(torch.bfloat16).double())
    return out.to(torch.bfloat16)


def check_native(args: dict, swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """The cuda backend into a NaN ``out`` against the W4A8 restatement (FP8 tolerance) and the
    bf16-activation reference (cosine distance <= 2e-3, rms error <= 8% of the output's)."""
    from flashdsa.runtime.moe.cuda.fused_moe import runs_natively

    x, w13, ids = args["x"], args["w13"], args["expert_ids"]
    assert runs_natively(w13.view(torch.uint8), args["w13_scale"], ids.numel() / w13.shape[0]), "not a native case"
    out = poisoned(x.shape, x.dtype, x.device)
    got = fused_moe(**args, swiglu_limit=swiglu_limit, out=out, backend="cuda")
    assert got is out
    assert_moe_close(got, w4a8_moe(**args, swiglu_limit=swiglu_limit), fp8=True)
    ref = fused_moe(**args, swiglu_limit=swiglu_limit, backend="reference").double().cpu()
    got = got.double().cpu()
    if ref.numel() and ref.abs().max() > 0:
        rms_err = (got - ref).square().mean().sqrt() / ref.square().mean().sqrt()
        assert cosine_distance(got, ref) <= 2e-3 and rms_err <= 0.08, (
            f"seed {SEED}: W4A8 vs bf16 activations: cosine distance {cosine_distance(got, ref):.3g}, "
            f"rms error {rms_err:.3g}")
    else:
        assert (got == 0).all(), f"seed {SEED}: no valid expert, yet nonzero outputs"
    return got


def fp4_inputs(tokens: int, top_k: int, experts: int, hidden: int, inter: int, salt: int, invalid: float = 0.0,
               expert_ids: Optional[torch.Tensor] = None) -> dict:
    args = moe_inputs(tokens, top_k, experts, hidden, inter, False, generator(40, salt, tokens), invalid=invalid,
                      device=cuda)
    if expert_ids is not None:
        args["expert_ids"] = expert_ids.to(torch.int32).to(cuda)
    return with_fp4_weights(args)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 32, 128])
@pytest.mark.parametrize("swiglu_limit", [None, 0.75])
def test_v4_widths_match_the_restatement(tokens, swiglu_limit):
    """V4-Flash expert widths, 64 experts (so blocks hold several pairs, at T=128 often over 8; at
    most 16 an expert on average, so the native kernels run), 5% invalid ids."""
    args = fp4_inputs(tokens, V4["top_k"], 64, V4["hidden"], V4["inter"], 1, invalid=0.05)
    flood_cuda_allocator_with_nan(cuda)
    check_native(args, swiglu_limit)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["one expert, three blocks", "every id invalid", "duplicate experts",
                                  "small widths", "no tokens", "one token, one slot"])
def test_corner_cases(case):
    g = torch.Generator().manual_seed(SEED)
    if case == "one expert, three blocks":  # 40 pairs on expert 3: blocks of 16, 16 and 8 pairs
        args = fp4_inputs(40, 1, 8, 256, 128, 2, expert_ids=torch.full((40, 1), 3))
    elif case == "every id invalid":
        args = fp4_inputs(6, 2, 8, 256, 128, 3, expert_ids=torch.tensor([[-1, 8]] * 3 + [[2**31 - 1, -(2**31)]] * 3))
    elif case == "duplicate experts":
        args = fp4_inputs(9, 4, 8, 256, 256, 4, expert_ids=torch.randint(0, 2, (9, 4), generator=g))
    elif case == "small widths":  # one CTA column tile, one 128-input chunk of the down GEMM
        args = fp4_inputs(3, 2, 4, 128, 128, 5, invalid=0.2)
    elif case == "no tokens":
        args = fp4_inputs(0, 6, 8, 256, 128, 6)
    else:
        args = fp4_inputs(1, 1, 256, 512, 384, 7)
    flood_cuda_allocator_with_nan(cuda)
    check_native(args, swiglu_limit=0.5 if case == "small widths" else None)


@pytest.mark.gpu
def test_automatic_dispatch_runs_natively_at_decode_sizes_only():
    """Without a backend argument an FP4 decode call takes the native kernels (bit-identical to
    forcing them) and a prefill-sized call the Triton ones (bit-identical to forcing triton)."""
    decode = fp4_inputs(4, 6, 64, 512, 256, 8)
    assert torch.equal(fused_moe(**decode), fused_moe(**decode, backend="cuda")), f"seed {SEED}"
    prefill = fp4_inputs(400, 6, 8, 256, 128, 9)  # 300 pairs an expert
    assert torch.equal(fused_moe(**prefill), fused_moe(**prefill, backend="triton")), f"seed {SEED}"


@pytest.mark.gpu
def test_no_host_sync_and_cuda_graph_replay():
    args = fp4_inputs(32, 6, 64, 512, 256, 10)
    x, ids = args["x"], args["expert_ids"]

    def refill():
        x.copy_(torch.randn(x.shape, generator=generator(41)).to(cuda, x.dtype))
        ids.copy_(torch.randint(0, 64, ids.shape, generator=generator(42)).to(cuda, ids.dtype))

    fused_moe(**args, backend="cuda")  # build and warm up outside the checks
    assert_sync_free_and_replayable(lambda: (fused_moe(**args, backend="cuda"),), refill)


@pytest.mark.gpu
def test_raw_op_refuses_misaligned_weights():
    from flashdsa.runtime.moe.cuda import fused_moe as native_moe  # noqa: F401  (builds and registers the ops)

    args = fp4_inputs(2, 2, 4, 256, 128, 11)
    w13 = args["w13"].view(torch.uint8)
    blocks = torch.zeros(1, dtype=torch.int32, device=cuda)
    pairs = torch.full((16,), -1, dtype=torch.int32, device=cuda)
    a = torch.zeros(2, 256, dtype=torch.uint8, device=cuda)
    h = torch.empty(16, 128, dtype=torch.uint8, device=cuda)
    h_scale = torch.empty(16, 4, device=cuda)
    with pytest.raises(RuntimeError, match="w must be"):
        torch.ops.flashdsa.fp4_moe_gate_up_cuda(a, torch.ones(2, 2, device=cuda), w13[:, :, 1:], args["w13_scale"],
                                                pairs, blocks, 2, 0.0, h, h_scale, 0)
    with pytest.raises(RuntimeError, match="a_scale must be"):
        torch.ops.flashdsa.fp4_moe_gate_up_cuda(a, torch.ones(2, 3, device=cuda), w13, args["w13_scale"], pairs,
                                                blocks, 2, 0.0, h, h_scale, 0)


def test_dispatch_declines_what_triton_runs_better():
    """The support check: non-FP4 experts and prefill sizes are declined (no fallback warning); a
    width the kernels cannot tile, more experts than the alignment holds, or fp32 activations are
    refused with their reason."""
    fp4 = dict(num_experts=256, dtype=torch.bfloat16, fp4_ue8m0=True, hidden=4096, inter=2048)
    assert isinstance(_cuda_supports(**fp4 | dict(fp4_ue8m0=False)), dispatch.Declined)
    assert isinstance(_cuda_supports(**fp4, pairs_per_expert=17.0), dispatch.Declined)
    refused = _cuda_supports(**fp4 | dict(hidden=4160), pairs_per_expert=1.0)
    assert "H and I multiples of 128" in refused and not isinstance(refused, dispatch.Declined)
    too_many = _cuda_supports(**fp4 | dict(num_experts=2048), pairs_per_expert=1.0)  # past the triton alignment
    assert "at most 1024 experts" in too_many and not isinstance(too_many, dispatch.Declined)
    fp32 = _cuda_supports(**fp4 | dict(dtype=torch.float32), pairs_per_expert=1.0)
    assert "bf16 activations" in fp32 and not isinstance(fp32, dispatch.Declined)


def run_memcheck_case() -> None:
    """Small cases with invalid ids, padding rows, a two-tile block and unused blocks."""
    check_native(fp4_inputs(33, 4, 12, 256, 128, 12, invalid=0.1))
    check_native(fp4_inputs(40, 1, 8, 256, 128, 13, expert_ids=torch.full((40, 1), 3)), swiglu_limit=0.5)
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(lambda: None, run_memcheck_case)
