"""Triton FP8 quantizer and block-scaled GEMM against the reference (fp8_gemm_cases.py gives the
inputs and the GEMM tolerance; quantizer bytes and scales must match exactly, since both divide
in IEEE fp32 and round to nearest even).

GPU tests (marked ``gpu``): every V3.2 linear shape at M = 1..8, 32, 64, 128, 600 (and 4096 for
four of them), shapes off multiples of 128 in bf16/fp16/fp32, every candidate launch shape the
sweep may pick, M = 0 and K = 0, and a sync-free, CUDA-graph-captured decode call. Outputs start
as NaN (the caching allocator is flooded first). The CPU test runs small cases in a subprocess
with TRITON_INTERPRET=1 and ``torch.empty`` poisoned.
"""

from __future__ import annotations

import pytest
import torch
from fp8_gemm_cases import SEED, assert_gemm_close, block_scaled, gemm_inputs, generator

from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP, fp8_gemm, fp8_linear, quantize_activations, quantize_weight
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
