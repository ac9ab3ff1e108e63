"""FP8 block-scaled GEMM and its quantizers: reference properties, input checks, the launch
heuristic, and the Triton kernels against the reference (GPU tests marked ``gpu``; the CPU test
runs small cases in a subprocess with TRITON_INTERPRET=1 and ``torch.empty`` poisoned).

Quantizers: Triton and reference give the same bytes and scales (both divide in IEEE fp32 and
round to nearest even), so they are compared exactly.

GEMM tolerance. Both sides see the same e4m3 operands and fp32 scales, so the kernel differs from
the fp32 reference only by (a) summation order in fp32 (~K * 2^-24 of the magnitude bound
``B = |x| @ |w|^T``, dequantized), (b) the SM90 tensor core's reduced-precision FP8 accumulation
inside each 128-deep group (each k32 MMA step adds with ~2^-13 of the step's magnitude, so at
most ~2^-11 of the group's share of B: 2^-10 allows twice that), and (c) rounding the output
(half an ulp: 2^-9 relative for bf16, 2^-11 fp16, 2^-24 fp32; we allow twice that). Elementwise:
``|got - ref| <= OUT_EPS * |ref| + 2^-10 * B``. In aggregate the relative Frobenius error must be
<= 2^-8: a dropped group of 56 (K = 7168) costs ~1/sqrt(56) = 0.13, a wrong scale index far
more, since the inputs' scales span 2^-6..2^6 per group and block.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.gemm import (
    GROUP,
    _triton_gemm_supports,
    fp8_gemm,
    fp8_linear,
    quantize_activations,
    quantize_weight,
    reference,
)
from flashdsa.runtime.gemm.triton.configs import DECODE_MAX_M, GemmConfig, candidates, choose, choose_config
from flashdsa.runtime.fp8 import AMAX_FLOOR, E4M3
from flashdsa.testing import flood_cuda_allocator_with_nan, kernel_test_main, poisoned_empty, run_under_interpreter

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
ACC_TOL = 2**-10
OUT_EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-10, torch.float32: 2**-23}
FROBENIUS_TOL = 2**-8
V32_SHAPES = {  # (N, K) of DeepSeek-V3.2's FP8 linear layers
    "q_a": (1536, 7168), "q_b": (24576, 1536), "kv_a": (576, 7168), "kv_b": (32768, 512),
    "o_proj": (7168, 16384), "dense_gate_up": (36864, 7168), "dense_down": (7168, 18432),
    "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048), "wq_b": (8192, 1536), "wk": (128, 7168),
}


def generator(*salt: int, device="cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(SEED + sum(s * 7919**i for i, s in enumerate(salt)))


def groups_of(n: int) -> int:
    return -(-n // GROUP)


def block_scaled(rows: int, k: int, row_block: int, g: torch.Generator) -> torch.Tensor:
    """Normal values [rows, k] (on g's device) whose magnitude jumps by 2^-6..2^6 between
    (row_block x 128) blocks, so a scale read from the wrong group or block is far off."""
    exponents = torch.randint(-6, 7, (groups_of(rows) if row_block > 1 else rows, groups_of(k)), generator=g,
                              device=g.device)
    magnitude = torch.exp2(exponents.float()).repeat_interleave(row_block, 0)[:rows]
    return torch.randn(rows, k, generator=g, device=g.device) * magnitude.repeat_interleave(GROUP, 1)[:, :k]


@functools.lru_cache(maxsize=None)
def weight(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled e4m3 weight [n, k] and its scales, made once per shape and device."""
    return reference.quantize_weight(block_scaled(n, k, GROUP, generator(n, k, device=device)))


def gemm_inputs(m: int, n: int, k: int, device) -> tuple[torch.Tensor, ...]:
    """(x_fp8, x_scale, w_fp8, w_scale) on ``device``, quantized by the reference (pow2 x scales)."""
    x_fp8, x_scale = reference.quantize_activations(block_scaled(m, k, 1, generator(m, n, k, device=device)), True)
    return (x_fp8, x_scale, *weight(n, k, str(torch.device(device))))


def fp8_abs(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) & 0x7F).view(E4M3)


def assert_gemm_close(got: torch.Tensor, x_fp8, x_scale, w_fp8, w_scale, what: str = "") -> None:
    """``got`` vs the fp32 reference within the module docstring's tolerance."""
    m, n = x_fp8.shape[0], w_fp8.shape[0]
    assert got.shape == (m, n), f"{what}: shape {list(got.shape)} != {[m, n]}"
    ref = reference.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.float32).double()
    bound = reference.fp8_gemm(fp8_abs(x_fp8), x_scale, fp8_abs(w_fp8), w_scale, torch.float32).double()
    out_eps = OUT_EPS[got.dtype]
    got = got.double()
    assert not got.isnan().any(), f"seed {SEED} {what}: {int(got.isnan().sum())} NaN (unwritten?) elements"
    err = (got - ref).abs()
    ratio = (err / (out_eps * ref.abs() + ACC_TOL * bound + 1e-30)).max().item() if err.numel() else 0.0
    assert ratio <= 1, f"seed {SEED} {what}: error {ratio:.3g}x the allowed bound, max abs err {err.max().item():.3g}"
    if ref.norm() > 0:
        frobenius = ((got - ref).norm() / ref.norm()).item()
        assert frobenius <= FROBENIUS_TOL, f"seed {SEED} {what}: relative Frobenius error {frobenius:.3g}"


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


def test_triton_gemm_reports_a_device_without_fp8_tensor_cores(monkeypatch):
    assert "compute capability >= 8.9), got (8, 0)" in _triton_gemm_supports(capability=(8, 0))
    assert _triton_gemm_supports(capability=(9, 0)) is None and _triton_gemm_supports() is None
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend 'triton' cannot run fp8_gemm: triton needs a CUDA device"):
        fp8_gemm(*good_inputs(), backend="triton")


# ---------------------------------------------------------------- launch heuristic


@pytest.mark.parametrize("name", sorted(V32_SHAPES))
@pytest.mark.parametrize("m", [1, 8, 32, 128, 4096])
def test_heuristic_fills_the_gpu_and_leads_its_candidates(name, m):
    n, k = V32_SHAPES[name]
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


# ---------------------------------------------------------------- Triton vs reference

SMALL_CONFIGS = [  # every kernel variant: swap / not, defer, split, TMA (K % 16 == 0) or pointer loads,
    # one weight scale per tile or a vector of them
    GemmConfig(16, 64, 3, swap_ab=True), GemmConfig(16, 32, 2, swap_ab=True, defer=True, tma=True),
    GemmConfig(32, 128, 1), GemmConfig(16, 256, 1, defer=True), GemmConfig(64, 64, 2, group_m=2, tma=True),
]


def check_quantizer(x: torch.Tensor, pow2: bool) -> None:
    got_q, got_s = quantize_activations(x, pow2_scales=pow2, backend="triton")
    want_q, want_s = quantize_activations(x, pow2_scales=pow2, backend="reference")
    assert torch.equal(got_s, want_s), f"seed {SEED}: scales differ at {int((got_s != want_s).sum())} places"
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), (
        f"seed {SEED}: {int((got_q.view(torch.uint8) != want_q.view(torch.uint8)).sum())} codes differ")


def check_gemm(m: int, n: int, k: int, device, config: GemmConfig | None = None, dtype=torch.bfloat16) -> None:
    inputs = gemm_inputs(m, n, k, device)
    if dtype == torch.float16:  # keep sums of 2^12-sized products inside fp16's range (pow2: exact)
        inputs = (inputs[0], inputs[1] * 2**-8, *inputs[2:])
    if config is None:
        got = fp8_gemm(*inputs, dtype, backend="triton")
    else:
        from flashdsa.runtime.gemm.triton import gemm as kernels

        got = kernels.fp8_gemm(*inputs, dtype, config=config)
    assert got.dtype == dtype
    assert_gemm_close(got, *inputs, what=f"M={m} N={n} K={k} {config or 'heuristic'} {dtype}")


def tricky_activations(device) -> torch.Tensor:
    """Rows: normal, all zero, large (still finite in fp16), tiny (subnormal codes), one whose
    amax / 448 is one ulp above a power of two; K = 300."""
    x = block_scaled(6, 300, 1, generator(7))
    x[1] = 0.0
    x[2] *= 100
    x[3] *= 1e-6
    x[4, :GROUP] = 0.0
    x[4, 7] = torch.nextafter(torch.tensor(448 * 2.0**-3), torch.tensor(1.0))
    return x.to(device)


def run_interpreter_cases() -> None:
    cpu = torch.device("cpu")
    with poisoned_empty():
        for pow2 in (False, True):
            x = tricky_activations(cpu)
            check_quantizer(x, pow2)
            check_quantizer(x.bfloat16(), pow2)
            check_quantizer(torch.randn(3, 1, generator=generator(8)), pow2)
            check_quantizer(x[:, 20:280], pow2)  # strided rows
        assert quantize_activations(torch.zeros(0, 50), backend="triton")[1].shape == (0, 1)
        for m, n, k in [(1, 200, 300), (5, 130, 256), (70, 256, 384), (3, 1, 100)]:
            check_gemm(m, n, k, cpu)
            for config in SMALL_CONFIGS:
                check_gemm(m, n, k, cpu, config)
        check_gemm(2, 64, 128, cpu, dtype=torch.float32)
        check_gemm(2, 64, 128, cpu, dtype=torch.float16)
        assert fp8_gemm(*gemm_inputs(0, 70, 300, cpu), backend="triton").shape == (0, 70)
        w_fp8, w_scale = quantize_weight(torch.randn(70, 300, generator=generator(10)))
        x = torch.randn(2, 3, 300, generator=generator(11)).bfloat16()
        got = fp8_linear(x, w_fp8, w_scale, pow2_scales=True, backend="triton")
        assert torch.equal(got, fp8_linear(x, w_fp8, w_scale, pow2_scales=True, backend="reference"))


def test_triton_under_interpreter():
    run_under_interpreter(__file__, SEED)


# ---------------------------------------------------------------- GPU

cuda = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantizer_gives_the_reference_bytes_and_scales(dtype, pow2):
    flood_cuda_allocator_with_nan(cuda)
    check_quantizer(tricky_activations(cuda).to(dtype), pow2)
    check_quantizer(block_scaled(4099, 7168, 1, generator(12, device=cuda)).to(dtype), pow2)
    check_quantizer(block_scaled(33, 900, 1, generator(13, device=cuda)).to(dtype)[:, 100:777], pow2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(V32_SHAPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 32, 64, 128, 600])
def test_v32_shapes_match_reference(name, m):
    flood_cuda_allocator_with_nan(cuda)
    check_gemm(m, *V32_SHAPES[name], cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q_a", "o_proj", "dense_down", "kv_a"])
def test_v32_prefill_shapes_match_reference(name):
    flood_cuda_allocator_with_nan(cuda)
    check_gemm(4096, *V32_SHAPES[name], cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 77, 129), (3, 1000, 1000), (9, 129, 300), (65, 200, 5000),
                                     (200, 300, 127), (1000, 333, 2049), (2049, 1025, 640), (5, 128, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shapes_off_multiples_of_128_match_reference(m, n, k, dtype):
    flood_cuda_allocator_with_nan(cuda)
    check_gemm(m, n, k, cuda, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 7168, 2048), (8, 1536, 7168), (32, 576, 1536), (128, 4096, 1000),
                                     (2048, 1536, 1536)])
def test_every_swept_config_matches_reference(m, n, k):
    """The sweep may pick any candidate, so each must be correct."""
    for config in candidates(m, n, k, torch.cuda.get_device_properties(cuda).multi_processor_count):
        flood_cuda_allocator_with_nan(cuda)
        check_gemm(m, n, k, cuda, config)


@pytest.mark.gpu
def test_empty_and_zero_depth_products():
    assert fp8_gemm(*gemm_inputs(0, 576, 7168, cuda), backend="triton").shape == (0, 576)
    x_fp8 = torch.zeros(3, 0, dtype=E4M3, device=cuda)
    w_fp8 = torch.zeros(5, 0, dtype=E4M3, device=cuda)
    out = fp8_gemm(x_fp8, torch.zeros(3, 0, device=cuda), w_fp8, torch.zeros(1, 0, device=cuda), backend="triton")
    assert out.shape == (3, 5) and (out == 0).all()


@pytest.mark.gpu
def test_fp8_linear_is_sync_free_and_replays_in_a_cuda_graph():
    """Decode-shaped calls (quantize, split-K GEMM and its sum) never sync with the host and give
    the same bits when replayed from a CUDA graph."""
    g = generator(15)
    w_fp8, w_scale = (t.to(cuda) for t in quantize_weight(torch.randn(7168, 2048, generator=g)))
    x = torch.randn(4, 2048, generator=g).to(cuda, torch.bfloat16)
    eager = fp8_linear(x, w_fp8, w_scale, pow2_scales=True, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp8_linear(x, w_fp8, w_scale, pow2_scales=True, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_linear(x, w_fp8, w_scale, pow2_scales=True, backend="triton")
    captured.fill_(float("nan"))
    graph.replay()
    assert torch.equal(captured, eager)


def run_memcheck_case() -> None:
    """Small GPU cases of both kernels, including the split-K sum and partial tiles, for compute-sanitizer."""
    check_quantizer(tricky_activations(cuda), True)
    for m, n, k in [(1, 200, 300), (70, 256, 384), (300, 130, 1000)]:
        check_gemm(m, n, k, cuda)
        for config in SMALL_CONFIGS:
            check_gemm(m, n, k, cuda, config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
