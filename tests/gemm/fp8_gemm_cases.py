"""Shared inputs and the tolerance of the FP8 GEMM tests (CPU and GPU).

Inputs: normal values whose magnitude jumps by 2^-6..2^6 between 128-wide activation groups and
128x128 weight blocks, quantized by the reference (power-of-two activation scales), so a scale
read from the wrong group or block is far off.

GEMM tolerance. Both sides see the same e4m3 operands and fp32 scales, so the kernel differs from
the fp32 reference only by (a) summation order in fp32 (~K * 2^-24 of the magnitude bound
``B = |x| @ |w|^T``, dequantized), (b) the SM90 tensor core's reduced-precision FP8 accumulation
inside each 128-deep group (each k32 MMA step adds with ~2^-13 of the step's magnitude, so at
most ~2^-11 of the group's share of B: 2^-10 allows twice that), and (c) rounding the output
(half an ulp: 2^-9 relative for bf16, 2^-11 fp16, 2^-24 fp32; we allow twice that). Elementwise:
``|got - ref| <= OUT_EPS * |ref| + 2^-10 * B``. In aggregate the relative Frobenius error must be
<= 2^-8: a dropped group of 56 (K = 7168) costs ~1/sqrt(56) = 0.13, a wrong scale index far
more. (A 1% error in the scales fails the elementwise bound on the interpreter's small shapes.)
"""

from __future__ import annotations

import functools
import os

import torch

from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP, reference

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
ACC_TOL = 2**-10
OUT_EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-10, torch.float32: 2**-23}
FROBENIUS_TOL = 2**-8


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
