"""Triton FP8 quantizer and block-scaled GEMM against the reference (fp8_gemm_cases.py gives the
inputs and the GEMM tolerance; quantizer bytes and scales must match exactly, since both divide
in IEEE fp32 and round to nearest even).

The one-launch decode linear (``gemm.fp8_linear``: quantizing in the GEMM, split K summed by the
last split through tickets) must give quantize-then-``fp8_gemm``'s bits with the same launch shape.

GPU tests (marked ``gpu``): every V3.2 linear shape at M = 1..8, 32, 64, 128, 600 (and 4096 for
four of them), shapes off multiples of 128 in bf16/fp16/fp32, every candidate launch shape the
sweep may pick, M = 0 and K = 0, a sync-free, CUDA-graph-captured decode call, and the one-launch
linear over 200 random split-K launches and replayed from a CUDA graph. Outputs start as NaN (the
caching allocator is flooded first). The CPU test runs small cases in a subprocess with
TRITON_INTERPRET=1 and ``torch.empty`` poisoned.
"""

from __future__ import annotations

import pytest
import torch
from fp8_gemm_cases import SEED, assert_gemm_close, block_scaled, gemm_inputs, generator, weight

from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP, fp8_gemm, fp8_linear, one_launch_pays, quantize_activations, quantize_weight
from flashdsa.runtime.gemm.triton.configs import V32_LINEAR_SHAPES, GemmConfig, candidates
from flashdsa.testing import flood_cuda_allocator_with_nan, kernel_test_main, poisoned_empty, run_under_interpreter


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


def one_launch_activations(m: int, k: int, dtype: torch.dtype, device, *salt: int) -> torch.Tensor:
    """[m, k] ``dtype`` block-scaled activations; row 0 all zero (amax at the floor) and row 1 huge
    (1e30; fp16: all rows 2^-8 smaller, as in check_gemm, and no huge row)."""
    x = block_scaled(m, k, 1, generator(m, k, *salt, device=device))
    x[0] = 0.0
    if dtype == torch.float16:
        x *= 2**-8
    elif m > 1:
        x[1] *= 1e30
    return x.to(dtype)


def check_one_launch(m: int, n: int, k: int, dtype: torch.dtype, pow2: bool, device,
                     config: GemmConfig | None = None, calls: int = 1) -> None:
    """``gemm.fp8_linear`` equals the Triton quantizer then ``fp8_gemm`` (same launch shape) bit for
    bit, ``calls`` times in a row on fresh inputs (the ticket counters reused: they must be back at
    0), and the fp32 reference within the GEMM tolerance."""
    from flashdsa.runtime.gemm.triton import gemm as kernels

    w_fp8, w_scale = weight(n, k, str(torch.device(device)))
    for call in range(calls):
        x = one_launch_activations(m, k, dtype, device, call)
        got = kernels.fp8_linear(x, w_fp8, w_scale, pow2, dtype, config=config)
        x_fp8, x_scale = quantize_activations(x, pow2_scales=pow2, backend="triton")
        want = kernels.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, dtype, config=config)
        what = f"M={m} N={n} K={k} {dtype} pow2={pow2} {config or 'heuristic'} call {call}"
        assert got.dtype == dtype and torch.equal(got, want), (
            f"seed {SEED} {what}: {int((got != want).sum())} of {got.numel()} differ from quantize + fp8_gemm")
        assert_gemm_close(got, x_fp8, x_scale, w_fp8, w_scale, what)
        counters = kernels._counters.get(x.device)
        assert counters is None or not counters.any(), f"{what}: ticket counters left at {counters.nonzero()}"


def check_grouped(m: int, groups: int, n: int, k: int, dtype: torch.dtype, pow2: bool, device,
                  config: GemmConfig | None = None) -> None:
    """A grouped projection (``groups`` weights [n, k] stacked) through the public ``fp8_linear``
    (one launch or quantize + grouped GEMM, by size) and, with ``config``, through both kernels with
    that launch shape (bit-equal to each other): each group's columns within the GEMM tolerance of
    that group's own product."""
    from flashdsa.runtime.gemm.triton import gemm as kernels

    w_fp8, w_scale = weight(groups * n, k, str(torch.device(device)))
    x = one_launch_activations(m, groups * k, dtype, device, groups)
    x_fp8, x_scale = quantize_activations(x, pow2_scales=pow2, backend="triton")
    what = f"M={m} groups={groups} N={n} K={k} {dtype} pow2={pow2} {config or 'heuristic'}"
    outs = [fp8_linear(x, w_fp8, w_scale, groups=groups, pow2_scales=pow2, backend="triton")]
    if config is not None:
        outs.append(kernels.fp8_linear(x, w_fp8, w_scale, pow2, dtype, config=config, groups=groups))
        outs.append(kernels.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, dtype, config=config, groups=groups))
        assert torch.equal(outs[1], outs[2]), f"seed {SEED} {what}: one launch != quantize + grouped GEMM"
    kb = k // GROUP
    for got in outs:
        assert got.shape == (m, groups * n) and got.dtype == dtype, what
        for g in range(groups):
            assert_gemm_close(got[:, g * n:(g + 1) * n], x_fp8[:, g * k:(g + 1) * k], x_scale[:, g * kb:(g + 1) * kb],
                              w_fp8[g * n:(g + 1) * n], w_scale[g * n // GROUP:(g + 1) * n // GROUP], f"{what} group {g}")


GROUPED_CASES = [  # (M, groups, N, K, dtype, pow2, config): swap-AB split K, TMA, tokens on the M side, prefill size
    (1, 3, 128, 256, torch.bfloat16, True, GemmConfig(16, 64, 2, swap_ab=True)),
    (3, 2, 256, 384, torch.float32, False, GemmConfig(16, 32, 3, swap_ab=True, tma=True)),
    (5, 2, 128, 256, torch.bfloat16, True, GemmConfig(16, 128, 1)),
    (70, 2, 128, 256, torch.bfloat16, False, None),
]

ONE_LAUNCH_CASES = [  # (M, N, K, dtype, pow2, config): M = 1, 3, 17, 64; N and K off multiples of 64 / 128
    (1, 70, 300, torch.bfloat16, True, GemmConfig(16, 64, 3, swap_ab=True)),
    (3, 130, 700, torch.float32, False, GemmConfig(16, 64, 2, swap_ab=True)),
    (17, 200, 256, torch.float16, True, GemmConfig(32, 64, 1, swap_ab=True)),
    (64, 64, 640, torch.bfloat16, False, GemmConfig(64, 32, 5, swap_ab=True)),
    (3, 100, 1000, torch.float32, True, None),
]


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
        assert got.shape == (2, 3, 70) and got.dtype == torch.bfloat16
        x_fp8, x_scale = quantize_activations(x.view(6, 300), pow2_scales=True, backend="reference")
        assert_gemm_close(got.view(6, 70), x_fp8, x_scale, w_fp8, w_scale, "fp8_linear")
        assert torch.equal(got.view(6, 70), fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, backend="triton"))
        for m, n, k, dtype, pow2, config in ONE_LAUNCH_CASES:
            check_one_launch(m, n, k, dtype, pow2, cpu, config, calls=2 if m == 1 else 1)
        for *shape, config in GROUPED_CASES:
            check_grouped(*shape, cpu, config)


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
@pytest.mark.parametrize("name", sorted(V32_LINEAR_SHAPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 32, 64, 128, 600])
def test_v32_shapes_match_reference(name, m):
    flood_cuda_allocator_with_nan(cuda)
    check_gemm(m, *V32_LINEAR_SHAPES[name], cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q_a", "o_proj", "dense_down", "kv_a"])
def test_v32_prefill_shapes_match_reference(name):
    flood_cuda_allocator_with_nan(cuda)
    check_gemm(4096, *V32_LINEAR_SHAPES[name], cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 77, 129), (3, 1000, 1000), (9, 129, 300), (65, 200, 5000),
                                     (200, 300, 127), (1000, 333, 2049), (2049, 1025, 640), (5, 128, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shapes_off_multiples_of_128_match_reference(m, n, k, dtype):
    flood_cuda_allocator_with_nan(cuda)
    check_gemm(m, n, k, cuda, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m, name", [(1, "shared_down"), (8, "q_a"), (32, "kv_a"), (128, "wq_b"), (4096, "shared_down")])
def test_every_swept_config_matches_reference(m, name):
    """The sweep may pick any candidate, so each must be correct (M = 2..8 compile like M = 8, and
    the shapes are the benchmark's, so the sweep reuses these compiled kernels)."""
    n, k = V32_LINEAR_SHAPES[name]
    for config in candidates(m, n, k, torch.cuda.get_device_properties(cuda).multi_processor_count):
        flood_cuda_allocator_with_nan(cuda)
        check_gemm(m, n, k, cuda, config)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 32, 600])
def test_grouped_v4_output_projection_matches_reference(m):
    """DeepSeek-V4-Flash's wo_a (8 groups of 4096 -> 1024) at decode and prefill sizes."""
    flood_cuda_allocator_with_nan(cuda)
    check_grouped(m, 8, 1024, 4096, torch.bfloat16, True, cuda)
    if m <= 4:
        check_grouped(m, 8, 1024, 4096, torch.bfloat16, True, cuda, GemmConfig(16, 64, 4, swap_ab=True))


@pytest.mark.gpu
def test_empty_and_zero_depth_products():
    assert fp8_gemm(*gemm_inputs(0, 576, 7168, cuda), backend="triton").shape == (0, 576)
    x_fp8 = torch.zeros(3, 0, dtype=E4M3, device=cuda)
    w_fp8 = torch.zeros(5, 0, dtype=E4M3, device=cuda)
    out = fp8_gemm(x_fp8, torch.zeros(3, 0, device=cuda), w_fp8, torch.zeros(1, 0, device=cuda), backend="triton")
    assert out.shape == (3, 5) and (out == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 128])
def test_fp8_linear_is_sync_free_and_replays_in_a_cuda_graph(m):
    """Decode-bucket calls (quantize, then the split-K GEMM and its sum at M = 4, the TMA tiles
    at M = 128) never sync with the host and give the same bits replayed from a CUDA graph."""
    g = generator(15, m)
    w_fp8, w_scale = (t.to(cuda) for t in quantize_weight(torch.randn(7168, 2048, generator=g)))
    x = torch.randn(m, 2048, generator=g).to(cuda, torch.bfloat16)
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


def test_one_launch_is_taken_only_where_the_h100_measured_it_faster():
    """bench_gemm --one-launch on an H100: faster for V3.2's kv_a (4.1 MB) and wk at 1 and 4 tokens;
    slower for q_a (11 MB) and up, and at 32 tokens for every layer."""
    fits = {name: one_launch_pays(m, *V32_LINEAR_SHAPES[name]) for name in ("kv_a", "wk", "q_a", "o_proj")
            for m in (1, 4, 32)}
    assert one_launch_pays(1, *V32_LINEAR_SHAPES["kv_a"]) and one_launch_pays(4, *V32_LINEAR_SHAPES["wk"])
    assert not any(one_launch_pays(32, *V32_LINEAR_SHAPES[name]) for name in ("kv_a", "wk")), fits
    assert not any(one_launch_pays(m, *V32_LINEAR_SHAPES[name]) for name in ("q_a", "o_proj") for m in (1, 4)), fits
    assert not one_launch_pays(0, 128, 128)


@pytest.mark.gpu
def test_one_launch_linear_matches_quantize_then_gemm_over_many_split_k_launches():
    """200 launches of random decode shapes (M 2..64, split K 2..8, N off multiples of 64, K a
    multiple of 128 or not), back to back without a sync, each bit-equal to quantize + fp8_gemm:
    a split whose partial tile were not visible to the last one would show. The dtype and scale
    kind go with the token block (bf16 pow2 at 16, fp32 at 32, fp16 pow2 at 64), and N and K stay
    multiples of 16, so ~16 kernel variants compile."""
    flood_cuda_allocator_with_nan(cuda)
    g = torch.Generator().manual_seed(SEED)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=g))

    for case in range(200):
        low, block_m, dtype, pow2 = ((2, 16, torch.bfloat16, True), (17, 32, torch.float32, False),
                                     (33, 64, torch.float16, True))[case % 3]
        m, n = draw(low, block_m), 16 * draw(1, 100)
        k = 128 * draw(2, 30) - 16 * draw(0, 1) * draw(1, 7)
        check_one_launch(m, n, k, dtype, pow2, cuda, GemmConfig(block_m, 64, draw(2, 8), swap_ab=True))


@pytest.mark.gpu
def test_one_launch_linear_replays_in_a_cuda_graph():
    """Two split-K one-launch linears (4 MiB then 1.2 MB e4m3 weights, K = 2048: 4 splits each, at
    M = 4, chained, small enough that fp8_linear takes the one launch) captured once and replayed
    five times on new inputs: each replay equals the eager calls, and the ticket counters are back at 0."""
    from flashdsa.runtime.gemm.triton import gemm as kernels

    shapes = [(2048, 2048), (576, 2048)]
    assert all(one_launch_pays(4, n, k) for n, k in shapes)
    layers = [weight(n, k, str(cuda)) for n, k in shapes]
    x = torch.empty(4, shapes[0][1], dtype=torch.bfloat16, device=cuda)

    def forward() -> list[torch.Tensor]:
        outs = [fp8_linear(x, *layers[0], pow2_scales=True, backend="triton")]
        outs.append(fp8_linear(outs[-1], *layers[1], pow2_scales=True, backend="triton"))
        return outs

    x.copy_(one_launch_activations(4, x.shape[1], x.dtype, cuda, 99))
    forward()  # warm-up outside the capture: compiles, and makes the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    for replay in range(5):
        x.copy_(block_scaled(4, x.shape[1], 1, generator(16, replay, device=cuda)))
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        eager = forward()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want), f"seed {SEED} replay {replay}: {int((got != want).sum())} differ"
    assert not kernels._counters[x.device].any()


def run_memcheck_case() -> None:
    """Small GPU cases of both kernels, including the split-K sum, the one-launch linear's tickets
    and partial tiles, for compute-sanitizer."""
    check_quantizer(tricky_activations(cuda), True)
    for m, n, k in [(1, 200, 300), (70, 256, 384), (300, 130, 1000)]:
        check_gemm(m, n, k, cuda)
        for config in SMALL_CONFIGS:
            check_gemm(m, n, k, cuda, config)
    for m, n, k, dtype, pow2, config in ONE_LAUNCH_CASES:
        check_one_launch(m, n, k, dtype, pow2, cuda, config, calls=2)
    for *shape, config in GROUPED_CASES:
        check_grouped(*shape, cuda, config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
