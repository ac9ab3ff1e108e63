"""FP8 block-scaled GEMM and its quantizers on CPU: the reference's properties (scales, pow2
rounding, clamping, all-zero rows, partial groups and blocks, the product), input checks and the
launch heuristic. The Triton kernels are tested against this reference in test_triton_fp8_gemm.py.
"""

from __future__ import annotations

import pytest
import torch
from fp8_gemm_cases import block_scaled, gemm_inputs, generator, groups_of

from flashdsa.runtime import dispatch
from flashdsa.runtime.fp8 import AMAX_FLOOR, E4M3
from flashdsa.runtime.gemm import (
    GROUP,
    _triton_gemm_supports,
    fp8_gemm,
    fp8_linear,
    quantize_activations,
    quantize_weight,
    reference,
)
from flashdsa.runtime.gemm.triton.configs import (
    DECODE_MAX_M,
    V32_LINEAR_SHAPES,
    GemmConfig,
    candidates,
    choose,
    choose_config,
)


# ---------------------------------------------------------------- reference properties (CPU)


def test_activation_scales_are_amax_over_448_per_group_and_values_round_trip():
    g = generator(1)
    x = block_scaled(5, 300, 1, g)  # last group 44 wide
    q, scale = quantize_activations(x)
    assert q.dtype == E4M3 and q.shape == (5, 300) and scale.shape == (5, 3)
    padded = torch.nn.functional.pad(x, (0, 84)).view(5, 3, GROUP)
    amax = padded.abs().amax(-1)
    assert torch.equal(scale, amax / torch.full_like(amax, 448.0))
    deq = q.float() * scale.repeat_interleave(GROUP, 1)[:, :300]
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4); subnormals are multiples of 2^-9
    assert ((deq - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale.repeat_interleave(GROUP, 1)[:, :300]).all()
    peak = (x.abs() == amax.repeat_interleave(GROUP, 1)[:, :300])
    assert (q.float().abs()[peak] == 448).all(), "each group's amax maps to the top of the e4m3 range"


def test_pow2_scales_are_the_smallest_power_of_two_at_or_above_amax_over_448():
    g = generator(2)
    x = block_scaled(4, 256, 1, g)
    just_above = torch.nextafter(torch.tensor(448 * 2.0**-10), torch.tensor(1.0))
    x[3, :GROUP] = 0.0
    x[3, 5] = just_above  # amax / 448 lands one ulp above 2^-10: the scale must be 2^-9
    q, scale = quantize_activations(x, pow2_scales=True)
    exact = reference._scale_of(x.view(4, 2, GROUP).abs().amax(-1), pow2=False)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all(), "scales are powers of two"
    assert (scale >= exact).all() and (scale / 2 < exact).all()
    assert scale[3, 0] == 2.0**-9
    assert q.float().abs().max() <= 448


def test_all_zero_rows_get_the_floor_scale_and_zero_codes():
    x = torch.zeros(3, 200)
    x[1, 150] = -3.0
    q, scale = quantize_activations(x)
    floor = torch.tensor(AMAX_FLOOR) / torch.tensor(448.0)
    assert torch.equal(scale[0], floor.expand(2)) and scale[1, 0] == floor
    assert (q.view(torch.uint8)[0] == 0).all()
    assert q[1, 150].float() == -448


def test_quantize_activations_accepts_strided_rows():
    x = torch.randn(6, 400, generator=generator(3))[:, 50:350]
    q, scale = quantize_activations(x)
    q2, scale2 = quantize_activations(x.contiguous())
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)


def test_weight_scales_are_amax_over_448_per_128x128_block_with_partial_blocks():
    g = generator(4)
    w = block_scaled(200, 300, GROUP, g)
    w_fp8, w_scale = quantize_weight(w)
    assert w_fp8.shape == (200, 300) and w_scale.shape == (2, 3)
    for nb in range(2):
        for kb in range(3):
            block = w[nb * GROUP:(nb + 1) * GROUP, kb * GROUP:(kb + 1) * GROUP]
            amax = block.abs().amax().clamp_min(AMAX_FLOOR)
            assert w_scale[nb, kb] == amax / torch.tensor(448.0)
    deq = reference.dequantize_weight(w_fp8, w_scale)
    assert ((deq - w).abs() <= 2**-4 * w.abs() + 2**-10 * w_scale.max()).all()


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (3, 200, 300), (17, 128, 256), (0, 5, 130)])
def test_reference_gemm_is_the_float64_product_of_the_dequantized_operands(m, n, k):
    x_fp8, x_scale, w_fp8, w_scale = gemm_inputs(m, n, k, "cpu")
    x = x_fp8.double() * x_scale.double().repeat_interleave(GROUP, 1)[:, :k]
    w = w_fp8.double() * w_scale.double().repeat_interleave(GROUP, 0)[:n].repeat_interleave(GROUP, 1)[:, :k]
    want = x @ w.T
    got = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item() if m else 0)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, dtype), got.to(dtype))


def test_fp8_linear_keeps_leading_dims_and_dtype():
    g = generator(5)
    w_fp8, w_scale = quantize_weight(torch.randn(70, 300, generator=g))
    x = torch.randn(2, 3, 300, generator=g).bfloat16()
    y = fp8_linear(x, w_fp8, w_scale, pow2_scales=True)
    assert y.shape == (2, 3, 70) and y.dtype == torch.bfloat16
    x_fp8, x_scale = quantize_activations(x.view(6, 300), pow2_scales=True)
    assert torch.equal(y.view(6, 70), fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.bfloat16))
    assert fp8_linear(x[:, :0], w_fp8, w_scale).shape == (2, 0, 70)
    assert fp8_linear(x[0, 0], w_fp8, w_scale).shape == (70,)


def test_grouped_fp8_linear_runs_each_group_through_its_own_rows():
    """``groups=3``: x's columns [256 g, 256 (g + 1)) through weight rows [128 g, 128 (g + 1)), as
    three separate linears would (the reference backend runs them group by group)."""
    g = generator(6)
    w_fp8, w_scale = quantize_weight(torch.randn(3 * 128, 256, generator=g))
    x = torch.randn(2, 5, 3 * 256, generator=g).bfloat16()
    y = fp8_linear(x, w_fp8, w_scale, groups=3, pow2_scales=True)
    want = torch.cat([fp8_linear(x[..., i * 256:(i + 1) * 256], w_fp8[i * 128:(i + 1) * 128], w_scale[i:i + 1],
                                 pow2_scales=True) for i in range(3)], dim=-1)
    assert y.shape == (2, 5, 384) and y.dtype == torch.bfloat16 and torch.equal(y, want)


# ---------------------------------------------------------------- input checks


def good_inputs():
    return gemm_inputs(4, 130, 300, "cpu")


@pytest.mark.parametrize("index, bad, message", [
    (0, lambda t: t.float(), "x_fp8 must be float8_e4m3fn"),
    (0, lambda t: t[None], "x_fp8 must be float8_e4m3fn"),
    (1, lambda t: t[:, :2], "x_scale must be fp32 .M=4, ceil.K/128.=3."),
    (1, lambda t: t.double(), "x_scale must be fp32"),
    (2, lambda t: t[:, :256], "w_fp8 must be float8_e4m3fn .N, K=300."),
    (2, lambda t: t.view(torch.uint8), "w_fp8 must be float8_e4m3fn"),
    (3, lambda t: t[:1], "w_scale must be fp32 .ceil.N/128.=2, ceil.K/128.=3."),
    (2, lambda t: t.t().contiguous().t(), "w_fp8 must be contiguous"),
    (0, lambda t: t.to("meta"), "x_scale must be on meta"),
])
def test_bad_gemm_inputs_raise_value_errors_naming_the_argument(index, bad, message):
    inputs = list(good_inputs())
    inputs[index] = bad(inputs[index])
    with pytest.raises(ValueError, match=message):
        fp8_gemm(*inputs)


def test_bad_out_dtype_and_bad_activations_raise_value_errors():
    with pytest.raises(ValueError, match="out_dtype must be one of bf16/fp16/fp32, got torch.int32"):
        fp8_gemm(*good_inputs(), torch.int32)
    with pytest.raises(ValueError, match="x must be bf16/fp16/fp32 .M, K."):
        quantize_activations(torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be bf16/fp16/fp32 .M, K."):
        quantize_activations(torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match="x must have K > 0"):
        quantize_activations(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="w must be bf16/fp16/fp32 .N, K."):
        quantize_weight(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="x must be a tensor"):
        fp8_linear([1.0], *good_inputs()[2:])
    with pytest.raises(ValueError, match="w_fp8 must be float8_e4m3fn .N, K=64."):
        fp8_linear(torch.zeros(2, 64), *good_inputs()[2:])
    w_fp8, w_scale = quantize_weight(torch.zeros(256, 128))
    with pytest.raises(ValueError, match="groups must be an int >= 1, got 0"):
        fp8_linear(torch.zeros(2, 256), w_fp8, w_scale, groups=0)
    with pytest.raises(ValueError, match="x must have K > 0 features a group .3 groups."):
        fp8_linear(torch.zeros(2, 256), w_fp8, w_scale, groups=3)
    with pytest.raises(ValueError, match="a grouped w_fp8 must have groups .4. x N rows, N and K multiples of 128"):
        fp8_linear(torch.zeros(2, 512), w_fp8, w_scale, groups=4)


def test_triton_gemm_reports_a_device_without_fp8_tensor_cores(monkeypatch):
    assert "compute capability >= 8.9), got (8, 0)" in _triton_gemm_supports(capability=(8, 0))
    assert _triton_gemm_supports(capability=(9, 0)) is None and _triton_gemm_supports() is None
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend 'triton' cannot run fp8_gemm: triton needs a CUDA device"):
        fp8_gemm(*good_inputs(), backend="triton")


# ---------------------------------------------------------------- launch heuristic


@pytest.mark.parametrize("name", sorted(V32_LINEAR_SHAPES))
@pytest.mark.parametrize("m", [1, 8, 32, 128, 4096])
def test_heuristic_fills_the_gpu_and_leads_its_candidates(name, m):
    n, k = V32_LINEAR_SHAPES[name]
    config = choose(m, n, k, 132)
    assert candidates(m, n, k, 132)[0] == config
    assert config.swap_ab == (m <= DECODE_MAX_M)
    groups = groups_of(k)
    assert 1 <= config.split_k <= max(1, groups // 4)
    programs = -(-m // config.block_m) * -(-n // config.block_n) * config.split_k
    if m <= DECODE_MAX_M and n * k >= 2**22:  # decode on a >= 4 MiB weight: every SM streams
        assert programs >= 132, f"{config}: {programs} programs"


def test_heuristic_choice_is_cached_per_power_of_two_m():
    cpu = torch.device("cpu")
    assert choose_config(3, 7168, 16384, cpu) is choose_config(4, 7168, 16384, cpu)
    assert choose_config(3000, 7168, 16384, cpu) is choose_config(4096, 7168, 16384, cpu)
    assert all(isinstance(c, GemmConfig) for c in candidates(5000, 576, 7168))
