"""fused_moe's reference backend against a plain float64 re-statement; its gradients; bad arguments.
The triton backend is checked against the reference in test_triton_moe.py."""

from __future__ import annotations

import pytest
import torch

from flashdsa.runtime.moe import fused_moe
from flashdsa.testing import poisoned
from moe_cases import SEED, assert_clip_matters, dense_moe, generator, moe_inputs, with_fp4_weights


def close_to_dense(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """Within ``rtol`` of the output's largest magnitude (the reference rounds to bf16 twice; FP8
    activation quantization adds e4m3 rounding: relative 2^-4 per value, averaging out)."""
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * scale, f"seed {SEED}: max error {err:.3g} vs output scale {scale:.3g}"


@pytest.mark.parametrize("tokens, top_k, experts, hidden, inter", [(1, 1, 1, 8, 4), (9, 3, 5, 130, 72),
                                                                   (16, 8, 32, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_matches_the_dense_restatement(tokens, top_k, experts, hidden, inter, dtype):
    args = moe_inputs(tokens, top_k, experts, hidden, inter, False, generator(tokens, experts), invalid=0.2,
                      dtype=dtype)
    got = fused_moe(**args, backend="reference")
    assert got.dtype == dtype
    close_to_dense(got, dense_moe(**args), 2**-6 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("pow2_scales", [False, True])
def test_reference_fp8_matches_the_dense_restatement(pow2_scales):
    args = moe_inputs(12, 4, 6, 200, 96, True, generator(12, pow2_scales), invalid=0.1)
    want = dense_moe(**args)
    # two GEMMs on e4m3 activations (power-of-two scales leave up to one mantissa bit unused): over
    # 200 seeds the worst element was 7.5% (8.1% with pow2) of the output scale; 2^-4 failed 1 in 20
    close_to_dense(fused_moe(**args, pow2_scales=pow2_scales, backend="reference"), want, 2**-3)
    dequantized = fused_moe(**args, quantize_activations=False, backend="reference")  # no activation rounding
    close_to_dense(dequantized, want, 2**-6)


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_clipped_swiglu_matches_the_dense_restatement(fp8):
    """DeepSeek-V4's ``silu(min(gate, L)) * clamp(up, -L, L)``, at a limit most |gate|, |up| cross."""
    args = moe_inputs(10, 3, 5, 160, 128, fp8, generator(8, fp8), invalid=0.1)
    limit = 0.5
    assert_clip_matters(args, limit)
    got = fused_moe(**args, swiglu_limit=limit, backend="reference")
    # FP8: the input and the clipped intermediate are both rounded to e4m3; over 150 seeds the worst
    # element was 9.2% of the output scale (2^-4 failed on one seed in about ten)
    close_to_dense(got, dense_moe(**args, swiglu_limit=limit), 2**-3 if fp8 else 2**-6)
    if fp8:
        dequantized = fused_moe(**args, quantize_activations=False, swiglu_limit=limit, backend="reference")
        close_to_dense(dequantized, dense_moe(**args, swiglu_limit=limit), 2**-6)


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu, torch.float32])
@pytest.mark.parametrize("tokens, top_k, experts, hidden, inter", [(1, 1, 1, 32, 32), (9, 3, 5, 160, 96),
                                                                   (16, 6, 32, 64, 32)])
def test_reference_fp4_matches_the_dense_restatement(scale_dtype, tokens, top_k, experts, hidden, inter):
    """Packed FP4 experts (K = H and I multiples of 32, not of 128) on unquantized activations:
    only the bf16 roundings of the intermediate and the pair outputs separate them from float64."""
    invalid = 0.2 if tokens * top_k > 1 else 0.0  # a lone pair made invalid would leave nothing to compare
    args = with_fp4_weights(moe_inputs(tokens, top_k, experts, hidden, inter, False, generator(tokens, hidden),
                                       invalid=invalid), scale_dtype)
    assert args["w13"].dtype == torch.int8 and args["w13_scale"].dtype == scale_dtype
    close_to_dense(fused_moe(**args, backend="reference"), dense_moe(**args), 2**-6)
    limit = 0.5
    assert_clip_matters(args, limit)
    close_to_dense(fused_moe(**args, swiglu_limit=limit, backend="reference"), dense_moe(**args, swiglu_limit=limit),
                   2**-6)


def test_out_buffer_and_no_tokens():
    args = moe_inputs(5, 2, 4, 16, 8, False, generator(3))
    out = poisoned((5, 16), torch.bfloat16)
    assert fused_moe(**args, out=out, backend="reference") is out
    assert torch.equal(out, fused_moe(**args, backend="reference"))
    empty = moe_inputs(0, 2, 4, 16, 8, False, generator(4))
    assert fused_moe(**empty, backend="reference").shape == (0, 16)


def test_reference_is_differentiable():
    """Training runs the reference: gradients reach x, the routing weights and the experts."""
    args = moe_inputs(6, 2, 3, 16, 8, False, generator(5), dtype=torch.float32)
    for name in ("x", "weights", "w13", "w2"):
        args[name].requires_grad_(True)
    fused_moe(**args, backend="reference").square().sum().backward()
    want = {name: torch.autograd.grad(dense_moe(**args).square().sum(), args[name])[0] for name in ("x", "weights")}
    for name in ("x", "weights"):
        torch.testing.assert_close(args[name].grad.double(), want[name].double(), rtol=1e-4, atol=1e-5,
                                   msg=f"seed {SEED}")
    assert args["w13"].grad.abs().sum() > 0 and args["w2"].grad.abs().sum() > 0


def base_args() -> dict:
    return moe_inputs(3, 2, 4, 16, 8, False, generator(6))


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.zeros(3, 16, dtype=torch.float16)), "x must be bf16/fp32/fp64 [T, H]"),
    (dict(x=torch.zeros(3, 0, dtype=torch.bfloat16)), "x must have H >= 1"),
    (dict(w13=torch.zeros(4, 16, 15, dtype=torch.bfloat16)), "w13 must be bfloat16 or e4m3 [E, 2*I, H=16]"),
    (dict(w13=torch.zeros(4, 15, 16, dtype=torch.bfloat16)), "w13 must stack gate and up rows"),
    (dict(w2=torch.zeros(4, 16, 9, dtype=torch.bfloat16)), "w2 must be bfloat16 [E=4, H=16, I=8] like w13"),
    (dict(w2=torch.zeros(4, 16, 8, dtype=torch.float8_e4m3fn)), "w2 must be bfloat16 [E=4, H=16, I=8] like w13"),
    (dict(w13_scale=torch.ones(4, 1, 1)), "w13_scale must be None for bfloat16 weights"),
    (dict(weights=torch.zeros(3, 2, dtype=torch.bfloat16)), "weights must be fp32 [T=3, top_k=2]"),
    (dict(weights=torch.zeros(3, 3)), "weights must be fp32 [T=3, top_k=2]"),
    (dict(expert_ids=torch.zeros(4, 2, dtype=torch.int32)), "expert_ids must be int32 [T=3, top_k >= 1]"),
    (dict(expert_ids=torch.zeros(3, 2, dtype=torch.int64)), "expert_ids must be int32 [T=3, top_k >= 1]"),
    (dict(pow2_scales=1), "pow2_scales must be a bool"),
    (dict(quantize_activations=None), "quantize_activations must be a bool"),
    (dict(out=torch.zeros(3, 16)), "out must be bfloat16 [T=3, H=16]"),
    *[(dict(swiglu_limit=bad), f"swiglu_limit must be a finite number > 0 or None, got {bad!r}")
      for bad in (0.0, -7.0, float("inf"), float("nan"), True, "10", torch.tensor(10.0))],
    (dict(x=torch.zeros(16, 3, dtype=torch.bfloat16).T), "x must be contiguous"),
])
def test_bad_arguments_name_themselves(change, message):
    with pytest.raises(ValueError) as e:
        fused_moe(**(base_args() | change))
    assert message in str(e.value)


@pytest.mark.parametrize("change, message", [
    (dict(w13_scale=None), "w13_scale must be a tensor fp32 [4, 1, 1]"),
    (dict(w2_scale=torch.ones(4, 1, 2)), "w2_scale must be fp32 [4, 1, 1]"),
])
def test_bad_fp8_scales_name_themselves(change, message):
    args = moe_inputs(3, 2, 4, 16, 8, True, generator(7))
    with pytest.raises(ValueError) as e:
        fused_moe(**(args | change))
    assert message in str(e.value)


def fp4_args() -> dict:
    return with_fp4_weights(moe_inputs(3, 2, 4, 64, 32, False, generator(8)))


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.zeros(3, 48, dtype=torch.bfloat16)), "FP4 experts need H a multiple of 32, got x [3, 48]"),
    (dict(w13=torch.zeros(4, 64, 64, dtype=torch.uint8)), "w13 must be bfloat16 or e4m3 [E, 2*I, H=64] or packed FP4"),
    (dict(w13=torch.zeros(4, 40, 32, dtype=torch.uint8)), "FP4 experts need I a multiple of 32, got w13 [4, 40, 32]"),
    (dict(w2=torch.zeros(4, 64, 16, dtype=torch.int8)), "w2 must be uint8 [E=4, H=64, I/2=16] like w13"),
    (dict(w2=torch.zeros(4, 64, 32, dtype=torch.uint8)), "w2 must be uint8 [E=4, H=64, I/2=16] like w13"),
    (dict(w13_scale=None), "w13_scale must be a tensor uint8/float8_e8m0fnu (UE8M0) or fp32 [4, 64, 2]"),
    (dict(w13_scale=torch.zeros(4, 64, 2, dtype=torch.bfloat16)), "w13_scale must be uint8/float8_e8m0fnu"),
    (dict(w2_scale=torch.zeros(4, 64, 2, dtype=torch.uint8)),
     "w2_scale must be uint8/float8_e8m0fnu (UE8M0) or fp32 [4, 64, 1]"),
    (dict(w2_scale=torch.zeros(4, 64, 1)), "w2_scale must have w13_scale's dtype uint8"),
])
def test_bad_fp4_arguments_name_themselves(change, message):
    args = fp4_args()
    args["w13"], args["w2"] = args["w13"].view(torch.uint8), args["w2"].view(torch.uint8)
    with pytest.raises(ValueError) as e:
        fused_moe(**(args | change))
    assert message in str(e.value)
