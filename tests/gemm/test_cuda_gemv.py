"""Native FP8 decode GEMV (``gemm/cuda/gemv.cu``) against the reference quantizer and GEMM.

The kernel quantizes the activations itself, and its codes and scales must be the reference's bit
for bit: through identity weights every output is one code times its scale, exactly, so the
outputs must equal the reference's dequantized activations (in x's dtype). On block-scaled random
weights (fp8_gemm_cases.py) the result must meet the FP8 GEMM tolerance against the fp32 reference
and, tighter, a float64 restatement of the same operands (reference codes times their scales,
weights times theirs): the kernel's products are exact and only its fp32 sums round, so
``|got - y64| <= OUT_EPS * |y64| + 2^-12 * (|x| @ |w|^T)``, where a wrong code, scale or block
costs more. Shapes: DeepSeek-V4-Flash's and V3.2's decode linears at M = 1..4 (every launch
shape: clusters of 1 to 8 CTAs, 16 to 128 rows a CTA), a grouped projection, N off multiples of
16 and 128, strided and misaligned rows, bf16/fp16/fp32, both scale rules; zero and huge
activations; a sync-free CUDA graph; the op's argument checks. Outputs start as NaN (the caching
allocator is flooded first). GPU tests (marked ``gpu``) need an SM90 GPU and nvcc; the support
check runs on the CPU. ``--memcheck`` runs small cases of every launch path for compute-sanitizer.
"""

from __future__ import annotations

import pytest
import torch
from fp8_gemm_cases import OUT_EPS, SEED, assert_gemm_close, block_scaled, generator, groups_of, weight

from flashdsa.runtime import dispatch, native
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP, reference
from flashdsa.runtime.gemm.cuda import MAX_K, MAX_M, SM90, supports
from flashdsa.testing import flood_cuda_allocator_with_nan, kernel_test_main

cuda = torch.device("cuda")
# of |x| @ |w|^T: the tensor core's fp32 sums (it aligns a k-step's products to the largest before adding, so
# low bits go; measured up to ~1.5e-4 at K = 128 in fp16). A wrong code or scale costs >= ~1/K of the sum.
RESTATEMENT_TOL = 2**-12

V4_SHAPES = {  # name: (N, K, groups) of DeepSeek-V4-Flash's FP8 linears at decode
    "q_a": (1024, 4096, 1), "q_b": (32768, 1024, 1), "kv": (512, 4096, 1), "index_q_b": (8192, 1024, 1),
    "o_a": (1024, 4096, 8), "o_b": (4096, 8192, 1), "shared_gate_up": (4096, 4096, 1),
    "shared_down": (4096, 2048, 1),
}
V32_SHAPES = {  # name: (N, K, groups) of DeepSeek-V3.2's
    "q_a": (1536, 7168, 1), "q_b": (24576, 1536, 1), "kv_a": (576, 7168, 1), "o_proj": (7168, 16384, 1),
    "wk": (128, 7168, 1),
}
SHAPES = {f"v4 {name}": shape for name, shape in V4_SHAPES.items()} | {f"v3.2 {name}": shape for name, shape in
                                                                      V32_SHAPES.items()}

on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == SM90
sm90 = pytest.mark.skipif(not on_sm90, reason="needs an SM90 GPU (H100/H200)")


@pytest.fixture(scope="module")
def gemv():
    """The native module (built on first use); skips where nvcc or a CUDA torch is missing."""
    reason = native.unavailable()
    if reason is not None:
        pytest.skip(reason)
    from flashdsa.runtime.gemm.cuda import gemv

    return gemv


def activations(m: int, k: int, dtype: torch.dtype, *salt: int) -> torch.Tensor:
    """[m, k] block-scaled activations (magnitudes 2^-6..2^6 per group of 128; fp16: 2^-8 smaller,
    so that the products' sums stay inside fp16's range)."""
    x = block_scaled(m, k, 1, generator(m, k, *salt, device=cuda))
    return (x * 2**-8 if dtype == torch.float16 else x).to(dtype)


def restatement(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor,
                w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, |x| @ |w|^T) in float64 from the quantized operands, scales applied in float64."""
    (m, k), n = x_fp8.shape, w_fp8.shape[0]
    x = x_fp8.double() * x_scale.double().repeat_interleave(GROUP, 1)[:, :k]
    w = w_fp8.double() * w_scale.double().repeat_interleave(GROUP, 0)[:n].repeat_interleave(GROUP, 1)[:, :k]
    return x @ w.T, x.abs() @ w.abs().T


def assert_close_to_restatement(got: torch.Tensor, x_fp8, x_scale, w_fp8, w_scale, what: str) -> None:
    y, bound = restatement(x_fp8, x_scale, w_fp8, w_scale)
    err = (got.double() - y).abs()
    ratio = (err / (OUT_EPS[got.dtype] * y.abs() + RESTATEMENT_TOL * bound + 1e-30)).max().item()
    assert ratio <= 1, f"seed {SEED} {what}: {ratio:.3g}x the float64 restatement's bound, max err {err.max():.3g}"


def check(gemv, x: torch.Tensor, n: int, groups: int, pow2: bool, what: str) -> torch.Tensor:
    """fp8_gemv of x through the cached block-scaled weight [groups * n, K] against the reference
    (per group) and the float64 restatement; returns the output."""
    m, k = x.shape[0], x.shape[1] // groups
    w_fp8, w_scale = weight(groups * n, k, str(cuda))
    flood_cuda_allocator_with_nan(cuda)
    got = gemv.fp8_gemv(x, w_fp8, w_scale, groups, pow2)
    assert got.dtype == x.dtype and got.shape == (m, groups * n), f"{what}: {got.dtype} {list(got.shape)}"
    for g in range(groups):
        rows, scale_rows = slice(g * n, (g + 1) * n), slice(g * n // GROUP, g * n // GROUP + groups_of(n))
        x_fp8, x_scale = reference.quantize_activations(x[:, g * k:(g + 1) * k], pow2)
        operands = (x_fp8, x_scale, w_fp8[rows], w_scale[scale_rows])
        part = f"{what} group {g}"
        assert_gemm_close(got[:, rows], *operands, what=part)
        assert_close_to_restatement(got[:, rows], *operands, what=part)
    return got


def identity_weight(k: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``groups`` stacked [k, k] identities in e4m3 (1.0) with unit block scales."""
    eye = torch.eye(k, device=cuda).to(E4M3).repeat(groups, 1)
    return eye, torch.ones(groups * k // GROUP, k // GROUP, device=cuda)


def tricky_activations(k: int, dtype: torch.dtype) -> torch.Tensor:
    """4 rows: block-scaled normal values; all zero (amax at the floor); tiny (subnormal codes) with a
    group whose amax / 448 is one ulp below a power of two; large (1e30, fp16: 100)."""
    x = block_scaled(4, k, 1, generator(k, 1, device=cuda))
    x[1] = 0.0
    x[2] *= 1e-6
    x[2, :GROUP] = 0.0
    x[2, 7] = torch.nextafter(torch.tensor(448 * 2.0**-3), torch.tensor(1.0))
    x[3] *= 100 if dtype == torch.float16 else 1e30
    return x.to(dtype)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_decode_shapes_match_reference_and_restatement(gemv, name, m, pow2):
    n, k, groups = SHAPES[name]
    check(gemv, activations(m, groups * k, torch.bfloat16, 1), n, groups, pow2, f"{name} M={m} pow2={pow2}")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k, groups", [(1024, 1), (1024, 2), (1536, 1), (7168, 1)])
def test_activation_codes_and_scales_are_the_reference_quantizers(gemv, k, groups, dtype, pow2):
    """Identity weights: out = the reference's dequantized activations, bit for bit, at M = 1..4."""
    w_fp8, w_scale = identity_weight(k, groups)
    x = tricky_activations(groups * k, dtype)
    for m in range(1, MAX_M + 1):
        flood_cuda_allocator_with_nan(cuda)
        got = gemv.fp8_gemv(x[-m:], w_fp8, w_scale, groups, pow2)
        x_fp8, x_scale = reference.quantize_activations(x[-m:], pow2)
        want = (x_fp8.float() * x_scale.repeat_interleave(GROUP, 1)).to(dtype)
        differ = (got != want).nonzero()
        assert not len(differ), (f"seed {SEED} K={k} groups={groups} {dtype} pow2={pow2} M={m}: {len(differ)} of "
                                 f"{got.numel()} differ, first at {differ[0].tolist()}")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, k", [(1, 128), (1, 4096), (200, 1024), (130, 7168), (576, 256), (4000, 2048)])
def test_rows_off_multiples_of_16_and_128(gemv, n, k, dtype):
    for m in (1, 4):
        check(gemv, activations(m, k, dtype, 2), n, 1, m == 4, f"N={n} K={k} M={m} {dtype}")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_strided_and_misaligned_rows(gemv, dtype):
    """Rows 16-byte aligned with a padded stride (vector loads), rows starting off 16 bytes (one
    load an input), and one row broadcast to four (row stride 0)."""
    k = 1536
    wide = activations(4, k + 40, dtype, 3)
    element = wide.element_size()
    aligned = wide[:, 16 // element:16 // element + k]
    assert aligned.data_ptr() % 16 == 0 and aligned.stride(0) * element % 16 == 0
    check(gemv, aligned, 576, 1, True, f"{dtype} aligned strided rows")
    check(gemv, wide[:, 1:1 + k], 576, 1, False, f"{dtype} misaligned rows")
    check(gemv, wide[:3, 2:2 + k], 4096, 1, True, f"{dtype} misaligned rows, M=3")
    check(gemv, wide[0, :k].expand(4, k), 1024, 1, True, f"{dtype} broadcast row")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_zero_activations_give_zeros(gemv, dtype):
    w_fp8, w_scale = weight(576, 7168, str(cuda))
    for pow2 in (False, True):
        flood_cuda_allocator_with_nan(cuda)
        got = gemv.fp8_gemv(torch.zeros(3, 7168, dtype=dtype, device=cuda), w_fp8, w_scale, 1, pow2)
        assert (got == 0).all(), f"seed {SEED} {dtype} pow2={pow2}: {int((got != 0).sum())} nonzero outputs"


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_huge_activations_stay_finite_and_match(gemv, dtype):
    """Activations near 1e30 (scales near 1e27) with the block-scaled weights (down to 2^-6)."""
    x = activations(4, 4096, dtype, 4)
    x[1:3] *= 1e30
    got = check(gemv, x, 1024, 1, True, f"{dtype} huge rows")
    assert got.isfinite().all(), f"seed {SEED}: {int((~got.isfinite()).sum())} non-finite outputs"


@pytest.mark.gpu
@sm90
def test_no_host_sync_and_cuda_graph_replay(gemv):
    """No host sync; a captured call replayed on new inputs written in place equals an eager call
    (the summation order is fixed, so bit for bit), and so does calling twice."""
    w_fp8, w_scale = weight(1024 * 8, 4096, str(cuda))
    x = activations(4, 8 * 4096, torch.bfloat16, 5)
    gemv.fp8_gemv(x, w_fp8, w_scale, 8, True)  # build and warm up outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gemv.fp8_gemv(x, w_fp8, w_scale, 8, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv.fp8_gemv(x, w_fp8, w_scale, 8, True)
    x.copy_(activations(4, 8 * 4096, torch.bfloat16, 6))
    graph.replay()
    eager = gemv.fp8_gemv(x, w_fp8, w_scale, 8, True)
    assert torch.equal(captured, eager), f"seed {SEED}: replay differs from eager"
    assert torch.equal(eager, gemv.fp8_gemv(x, w_fp8, w_scale, 8, True)), f"seed {SEED}: two calls differ"


@pytest.mark.gpu
@sm90
def test_raw_op_names_the_argument_it_refuses(gemv):
    w_fp8, w_scale = weight(256, 1024, str(cuda))
    x = torch.zeros(2, 1024, dtype=torch.bfloat16, device=cuda)
    out = torch.empty(2, 256, dtype=torch.bfloat16, device=cuda)
    good = dict(x=x, w=w_fp8, w_scale=w_scale, groups=1, pow2_scales=True, out=out)

    def refused(match: str, **change) -> None:
        args = good | change
        with pytest.raises(RuntimeError, match=match):
            torch.ops.flashdsa.fp8_gemv_cuda(*args.values(), torch.cuda.current_stream().cuda_stream)

    refused("x must be a CUDA", x=x.cpu())
    refused("x must be a CUDA", x=torch.zeros(1024, 2, dtype=torch.bfloat16, device=cuda).t())
    refused("x must be bf16, fp16 or fp32", x=x.double())
    refused("x must have 1 to 4 rows", x=torch.zeros(5, 1024, dtype=torch.bfloat16, device=cuda))
    refused("w must be a contiguous float8_e4m3fn", w=w_fp8.view(torch.uint8))
    refused("w must be a contiguous float8_e4m3fn", w=w_fp8.t())
    refused("w must start on a 16-byte boundary", w=w_fp8.view(-1)[8:8 + 255 * 1024].view(255, 1024),
            w_scale=w_scale[:2])
    refused("K must be a multiple of 128", x=x[:, :1000], w=w_fp8[:, :1000].contiguous(), w_scale=w_scale[:, :8])
    refused("groups must be >= 1", groups=0)
    refused("groups must be >= 1 and divide", groups=3)
    refused("grouped weights need N", x=torch.zeros(2, 4 * 1024, dtype=torch.bfloat16, device=cuda), groups=4)
    refused("x must have groups\\*K = 1024 columns", x=x[:, :896])
    refused("w_scale must be an fp32 \\[2, 8\\]", w_scale=w_scale[:1])
    refused("w_scale must be an fp32", w_scale=w_scale.double())
    refused("out must be a BFloat16 \\[2, 256\\]", out=out.float())
    refused("out must be a BFloat16 \\[2, 256\\]", out=out[:1])


@pytest.mark.gpu
@sm90
def test_fp8_linear_takes_the_native_gemv_at_decode_sizes(gemv, monkeypatch):
    """The public fp8_linear runs the native GEMV at 1..4 tokens (its bits) and the composed path at 5;
    a forced ``cuda`` backend runs the composed path for the calls the kernel declines, and a forced
    ``triton`` one never the native kernel."""
    from flashdsa.runtime.gemm import composed_linear, fp8_linear

    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    w_fp8, w_scale = weight(1024, 4096, str(cuda))
    for m in (1, MAX_M):
        x = activations(m, 4096, torch.bfloat16, 50)
        assert torch.equal(fp8_linear(x, w_fp8, w_scale, pow2_scales=True), gemv.fp8_gemv(x, w_fp8, w_scale, 1, True))
    x = activations(MAX_M + 1, 4096, torch.bfloat16, 51)
    want = composed_linear(x, w_fp8, w_scale, 1, True, None)
    assert torch.equal(fp8_linear(x, w_fp8, w_scale, pow2_scales=True), want)
    assert torch.equal(fp8_linear(x, w_fp8, w_scale, pow2_scales=True, backend="cuda"), want)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert torch.equal(fp8_linear(x[:1], w_fp8, w_scale, pow2_scales=True),
                       composed_linear(x[:1], w_fp8, w_scale, 1, True, "triton"))


def test_fp8_linear_declines_what_the_native_gemv_cannot_take():
    """Declined, not refused: automatic selection moves on to the composed path without a warning."""
    from flashdsa.runtime.gemm import _native_linear_supports

    assert _native_linear_supports(m=1, n=1024, k=4096, groups=1, capability=SM90) is None
    for facts in (dict(m=MAX_M + 1), dict(capability=(10, 0)), dict(k=4000)):
        reason = _native_linear_supports(**(dict(m=1, n=1024, k=4096, groups=1, capability=SM90) | facts))
        assert isinstance(reason, dispatch.Declined), facts


def test_support_check_names_what_it_cannot_take():
    assert supports(1, 1024, 4096, 1, SM90) is None
    assert supports(MAX_M, 8 * 1024, 4096, 8, SM90) is None
    assert supports(3, 200, MAX_K, 1, (9, 0)) is None
    assert "SM90" in supports(1, 1024, 4096, 1, (8, 9))
    assert "SM90" in supports(1, 1024, 4096, 1, (10, 0))
    assert "SM90" in supports(1, 1024, 4096, 1, None)
    assert "1 to 4 tokens" in supports(0, 1024, 4096, 1, SM90)
    assert "1 to 4 tokens" in supports(MAX_M + 1, 1024, 4096, 1, SM90)
    assert "multiple of 128" in supports(1, 1024, 4000, 1, SM90)
    assert "multiple of 128" in supports(1, 1024, 0, 1, SM90)
    assert f"[128, {MAX_K}]" in supports(1, 1024, MAX_K + GROUP, 1, SM90)
    assert "groups >= 1" in supports(1, 1024, 4096, 0, SM90)
    assert "dividing" in supports(1, 1000, 4096, 3, SM90)
    assert "N a multiple of 128" in supports(1, 2 * 200, 4096, 2, SM90)


def run_memcheck_case() -> None:
    """Small cases of every path: one CTA of one row, 16-row CTAs in clusters of 8 whose last CTAs
    get no K block (K = 1536: 12 blocks over 8), 128-row CTAs, grouped weights, misaligned fp32 rows."""
    from flashdsa.runtime.gemm.cuda import gemv as module

    check(module, activations(4, 128, torch.bfloat16, 7), 1, 1, True, "memcheck N=1 K=128")
    check(module, activations(3, 1536, torch.float16, 8), 200, 1, False, "memcheck N=200 K=1536")
    check(module, activations(2, 1024, torch.bfloat16, 9), 32768, 1, True, "memcheck N=32768 K=1024")
    check(module, activations(1, 4 * 1024, torch.bfloat16, 10), 256, 4, True, "memcheck groups=4")
    check(module, activations(4, 2048 + 1, torch.float32, 11)[:, 1:], 576, 1, False, "memcheck misaligned")
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(lambda: None, run_memcheck_case)
