"""swiglu (reference and triton backends): torch's clamp, silu and product, and a float64
re-statement; the triton kernel runs under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import pytest
import torch

from flashdsa.runtime.moe import swiglu
from flashdsa.testing import flood_cuda_allocator_with_nan, kernel_test_main, poisoned_empty, run_under_interpreter
from moe_cases import SEED, assert_sync_free_and_replayable, generator

V4_FLASH_INTER, V4_FLASH_LIMIT = 2048, 10.0  # DeepSeek-V4-Flash's shared expert width and swiglu_limit
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def restated(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(g, L)) * clamp(u, -L, L)`` in float64, L rounded to the inputs' dtype."""
    g, u = gate.double(), up.double()
    if limit is not None:
        bound = torch.tensor(limit, dtype=gate.dtype, device=gate.device).double()
        g, u = torch.minimum(g, bound), u.clamp(-bound, bound)
    return g * torch.sigmoid(g) * u


def fused_halves(tokens: int, inter: int, dtype: torch.dtype, g: torch.Generator, scale: float,
                 device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as the two strided halves of one ``[T, 2I]`` GEMM output, about N(0, scale^2)."""
    fused = (torch.randn(tokens, 2 * inter, generator=g) * scale).to(device, dtype)
    return fused[:, :inter], fused[:, inter:]


def check_swiglu(gate, up, limit, backend=None) -> torch.Tensor:
    """The op equals torch's ops within 2 ulps of a 16-bit dtype (but in a rare element: equal) and 4 fp32 ulps (torch's CPU silu
    takes a vectorized exp, the interpreter NumPy's: 2.9 ulps seen; on a GPU both are libdevice's),
    both within rounding of the float64 math; NaN where torch has NaN. Returns the finite values."""
    flood_cuda_allocator_with_nan(gate.device)
    with poisoned_empty():
        got = swiglu(gate, up, limit, backend=backend)
    want = swiglu(gate, up, limit, backend="reference")
    assert got.dtype == gate.dtype and got.shape == gate.shape and got.is_contiguous()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"seed {SEED}: NaN where torch has none, or the reverse"
    got, want, exact = got[~nan].double(), want[~nan].double(), restated(gate, up, limit)[~nan]
    info = torch.finfo(gate.dtype)
    # 16-bit: an fp32 ulp of exp rarely moves silu's 16-bit rounding by one ulp, which the product
    # scales to up to 2 ulps of its own (seen once in ~10^5 under the interpreter)
    ulps = 4 if gate.dtype == torch.float32 else 2
    off = (got - want).abs() > ulps * info.eps * want.abs() + info.tiny
    assert not off.any(), f"seed {SEED}: {int(off.sum())} of {off.numel()} off torch's, first {got[off][:4]}"
    if gate.dtype != torch.float32:  # that is rare: torch's roundings are the kernel's
        differ = int((got != want).sum())
        assert differ <= 2 + got.numel() // 500, f"seed {SEED}: {differ} of {got.numel()} differ from torch's"
    # below a gate of -87 the fp32 sigmoid is subnormal (torch's and the kernel's silu lose its digits alike)
    tame = gate.double()[~nan] > -87.0
    torch.testing.assert_close(got[tame], exact[tame], rtol=max(2, ulps) * info.eps, atol=2 * info.tiny,
                               msg=f"seed {SEED}")
    return got


CASES = [  # tokens, inter, limit, scale of the inputs
    (3, 96, 0.75, 1.0),  # most values past the clip
    (2, 1500, 10.0, 20.0),  # V4's limit; two column blocks, a masked tail
    (4, 64, 0.7, 1.0),  # a limit bf16 rounds (0.69921875)
    (5, 33, None, 4.0),  # plain SwiGLU (V3.2's MLP)
    (1, 1, 1.0, 3.0),
]


@pytest.mark.parametrize("tokens, inter, limit, scale", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_torch_on_strided_halves(tokens, inter, limit, scale, dtype, backend=None):
    g = generator(tokens, inter, int(scale), DTYPES.index(dtype))
    gate, up = fused_halves(tokens, inter, dtype, g, scale)
    got = check_swiglu(gate, up, limit, backend)
    if limit is not None and inter > 1:  # the clip changed something
        assert (got - restated(gate, up, None).flatten()).abs().max() > 0, f"seed {SEED}: the clip never bit"


def test_clip_bounds_infinities_and_passes_nan(backend=None):
    """Past the limit both ways, +-inf, huge negative gates (silu -> -0), NaN in gate and in up."""
    g = generator(21)
    gate, up = fused_halves(2, 40, torch.bfloat16, g, 2.0)
    gate[0, :6] = torch.tensor([float("inf"), -1e30, 1e30, float("nan"), 11.0, -11.0])
    up[0, :6] = torch.tensor([float("-inf"), float("inf"), float("nan"), 1.0, -1e30, 2.0])
    got = swiglu(gate, up, V4_FLASH_LIMIT, backend=backend)
    assert got[0, 0] == torch.nn.functional.silu(torch.tensor(10.0).bfloat16()) * -10.0
    assert got[0, 1] == 0 and got[0, 2].isnan() and got[0, 3].isnan()
    check_swiglu(gate, up, V4_FLASH_LIMIT, backend)


def test_no_tokens():
    assert swiglu(torch.zeros(0, 8), torch.zeros(0, 8), 1.0).shape == (0, 8)


def test_reference_is_differentiable():
    """Fine-tuning runs the reference: gradients flow to gate and up (none past the clip)."""
    gate = torch.tensor([[0.5, 12.0]], dtype=torch.float64, requires_grad=True)
    up = torch.tensor([[2.0, -0.25]], dtype=torch.float64, requires_grad=True)
    swiglu(gate, up, 10.0, backend="reference").sum().backward()
    assert gate.grad[0, 0] != 0 and gate.grad[0, 1] == 0 and up.grad[0, 0] != 0


@pytest.mark.parametrize("change, message", [
    (dict(gate=torch.zeros(2, 8, dtype=torch.int32)), "gate must be bf16/fp16/fp32/fp64 [T, I]"),
    (dict(gate=torch.zeros(2, 8, 1)), "gate must be bf16/fp16/fp32/fp64 [T, I]"),
    (dict(up=torch.zeros(2, 7)), "up must be float32 [2, 8] like gate"),
    (dict(up=torch.zeros(2, 8).bfloat16()), "up must be float32 [2, 8] like gate"),
    (dict(gate=torch.zeros(8, 2).T), "gate must have contiguous rows"),
    (dict(limit=0.0), "limit must be a number > 0"),
    (dict(limit=float("nan")), "limit must be a number > 0"),
    (dict(limit=True), "limit must be a number > 0"),
])
def test_bad_arguments_name_themselves(change, message):
    args = dict(gate=torch.zeros(2, 8), up=torch.zeros(2, 8), limit=1.0) | change
    with pytest.raises(ValueError) as e:
        swiglu(**args)
    assert message in str(e.value)


def test_triton_swiglu_is_reference_only_in_fp64():
    from flashdsa.runtime.moe import _triton_activates

    assert _triton_activates(torch.bfloat16) is None
    assert "got torch.float64" in _triton_activates(torch.float64)


def triton_cases() -> None:
    for case in CASES:
        for dtype in DTYPES:
            test_swiglu_matches_torch_on_strided_halves(*case, dtype, backend="triton")
    test_clip_bounds_infinities_and_passes_nan(backend="triton")


def test_triton_swiglu_under_interpreter():
    run_under_interpreter(__file__, SEED)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 4096])
def test_triton_swiglu_equals_torch_bit_for_bit_on_gpu(tokens):
    """V4-Flash's shared expert (I = 2048, L = 10) on the halves of a fused gate|up output, bf16:
    torch's clamp, silu and product exactly (libdevice expf and an IEEE division, as torch), also
    unclipped and in fp32; no host sync; a captured CUDA graph replays it."""
    g = generator(22, tokens)
    for dtype, limit in ((torch.bfloat16, V4_FLASH_LIMIT), (torch.bfloat16, None), (torch.float32, V4_FLASH_LIMIT)):
        gate, up = fused_halves(tokens, V4_FLASH_INTER, dtype, g, 8.0, device="cuda")
        got = swiglu(gate, up, limit, backend="triton")
        want = swiglu(gate, up, limit, backend="reference")
        differ = int((got != want).sum())
        assert differ == 0, f"seed {SEED}: {differ} of {got.numel()} differ from torch ({dtype}, limit {limit})"
        check_swiglu(gate, up, limit)
    assert_sync_free_and_replayable(lambda: (swiglu(gate, up, V4_FLASH_LIMIT),),
                                    lambda: gate.copy_(torch.randn(gate.shape, generator=g)))


if __name__ == "__main__":
    kernel_test_main(triton_cases, lambda: test_triton_swiglu_equals_torch_bit_for_bit_on_gpu(32))
