"""FP8 block-scaled GEMM through cuBLAS: ``torch._scaled_mm`` with DeepSeek's blockwise scales.

cuBLAS (12.9+, reached through torch >= 2.9) scales each 128-deep step of the product by
``x_scale[m, k // 128] * w_scale[n // 128, k // 128]``: the reference's function. On an H100 at
M = 4096 it runs 1.1-1.8x faster than the Triton kernel (benchmarks/bench_gemm.py); at M <= 64 it
is slower or refuses (M = 1: NOT_SUPPORTED), so this backend declines M < CUBLAS_MIN_M and decode
stays on Triton.

Layouts torch asks for: ``x_scale`` ``[M, K/128]`` outer-dim-major (strides ``(1, M)``: one copy
of M * K/128 floats a call) and the weight scales as ``[K/128 padded to 4, N/128]`` with strides
``(1, padded K/128)``. Only K a multiple of 512 is served: then the padding is empty and the
checkpoint's own contiguous ``[N/128, K/128]`` scale, transposed as a view, already is that
layout, so nothing is prepared at load or copied per call for the weights (every V3.2 K is such a
multiple; other K run on Triton).

Whether this torch, cuBLAS and GPU take the recipe and give the reference's numbers is probed once
per device with one small product compared against the reference (a host sync, so never while a
CUDA graph is being captured: until probed, a capturing call declines). A shape cuBLAS refuses at
run time runs on Triton from then on, logged once per shape. Nothing here syncs after the probe,
so captured calls replay.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from flashdsa.runtime.dispatch import Declined
from flashdsa.runtime.gemm import reference
from flashdsa.runtime.gemm.reference import GROUP

logger = logging.getLogger(__name__)

CUBLAS_MIN_M = 256  # below, the Triton GEMM is as fast or faster (H100: M <= 64 slower, M = 1 refused)
K_MULTIPLE = 4 * GROUP  # the weight scales' K/128 a multiple of 4: cuBLAS's padding is empty
N_MULTIPLE = 16  # cuBLASLt FP8 operands and output: 16-byte aligned rows
# The activation scales go over outer-dim-major, leading dimension M: on an H100 cuBLASLt refused
# M = 513, 777, 2049 and 4097 and took M = 256, 300, 1000 and 16384 (16-byte aligned columns).
M_MULTIPLE = 4
MIN_CAPABILITY = (9, 0)  # blockwise scaling in cuBLASLt: Hopper onwards
PROBE_SHAPE = (CUBLAS_MIN_M + 8, 2 * GROUP + 16, K_MULTIPLE)  # (M, N, K): partial tiles on both sides
PROBE_TOL = 2**-8  # relative Frobenius error of the probe against the fp32 reference

_probed: dict[int, Optional[str]] = {}  # CUDA device index -> None (usable) or why not
_refused: set[tuple[int, int]] = set()  # (N, K) that cuBLAS refused at run time


def shape_refusal(m: int, n: int, k: int, out_dtype: torch.dtype) -> Optional[str]:
    """Why this backend does not take ``[m, k] x [n, k]^T -> out_dtype`` (``Declined`` where it could
    but Triton is faster), or None. Pure: no device needed."""
    if out_dtype != torch.bfloat16:
        return f"cublas fp8_gemm writes bf16 only, got {out_dtype}"
    if k % K_MULTIPLE or n % N_MULTIPLE:
        return f"cublas fp8_gemm needs K % {K_MULTIPLE} == 0 and N % {N_MULTIPLE} == 0, got N={n} K={k}"
    if (n, k) in _refused:
        return f"cuBLAS refused N={n} K={k} before"
    if m < CUBLAS_MIN_M:
        return Declined(f"M={m} < CUBLAS_MIN_M={CUBLAS_MIN_M}: the Triton GEMM is faster there")
    if m % M_MULTIPLE:
        return f"cublas fp8_gemm needs M % {M_MULTIPLE} == 0 (its activation scales' leading dimension), got M={m}"
    return None


def supports(on: Optional[torch.device] = None, capability: Optional[tuple[int, int]] = None, m: int = 0,
             n: int = 0, k: int = 0, out_dtype: torch.dtype = torch.bfloat16, **_) -> Optional[str]:
    """The dispatcher's support check for a call on device ``on``: its capability, the shape, then the
    once-per-device probe."""
    if capability is None or capability < MIN_CAPABILITY:
        return f"cublas blockwise FP8 needs compute capability >= {MIN_CAPABILITY}, got {capability}"
    return shape_refusal(m, n, k, out_dtype) or probe(on or torch.device("cuda"))


def probe(device: torch.device) -> Optional[str]:
    """None if blockwise ``torch._scaled_mm`` runs on ``device`` and matches the reference, else why
    not; measured once per device (``Declined``, and not cached, while a CUDA graph is captured)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _probed:
        if torch.cuda.is_current_stream_capturing():
            return Declined("cuBLAS blockwise FP8 is not probed yet on this device (a CUDA graph is being captured)")
        _probed[index] = _run_probe(torch.device("cuda", index))
        if _probed[index] is not None:
            logger.info("fp8_gemm stays on Triton on cuda:%d: %s", index, _probed[index])
    return _probed[index]


def _run_probe(device: torch.device) -> Optional[str]:
    m, n, k = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    magnitude = torch.exp2(torch.randint(-4, 5, (m, k // GROUP), generator=g).float()).repeat_interleave(GROUP, 1)
    x_fp8, x_scale = reference.quantize_activations((torch.randn(m, k, generator=g) * magnitude).to(device), True)
    w_fp8, w_scale = reference.quantize_weight(torch.randn(n, k, generator=g).to(device))
    w_scale = w_scale * torch.exp2(torch.randint(-4, 5, w_scale.shape, generator=g).float()).to(device)
    try:
        got = scaled_mm(x_fp8, x_scale, w_fp8, w_scale, torch.bfloat16).double()
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        return f"torch._scaled_mm refuses blockwise scales here: {str(e).strip().splitlines()[0][:200]}"
    want = reference.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.float32).double()
    error = ((got - want).norm() / want.norm()).item()
    if not error <= PROBE_TOL:
        return f"cuBLAS blockwise product is off the reference (relative error {error:.3g} > {PROBE_TOL:.3g})"
    return None


def cublas_scales(x_scale: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale_a, scale_b)`` as ``torch._scaled_mm`` takes them for ``x @ w.t()``: ``x_scale: [M, K/128]``
    copied outer-dim-major (strides ``(1, M)``); ``w_scale: [N/128, K/128]`` contiguous (K/128 a
    multiple of 4) viewed as ``[K/128, N/128]`` with strides ``(1, K/128)``, no copy."""
    return x_scale.t().contiguous().t(), w_scale.t()


def scaled_mm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """The bare cuBLAS product (raises where torch or cuBLAS refuse); shapes as :func:`fp8_gemm`."""
    scale_a, scale_b = cublas_scales(x_scale, w_scale)
    return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """x_fp8: [M, K] e4m3, x_scale: [M, K/128] fp32, w_fp8: [N, K] e4m3, w_scale: [ceil(N/128), K/128]
    fp32 -> [M, N] bf16. A refusal by cuBLAS runs this call, and the shape from then on, on Triton."""
    try:
        return scaled_mm(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
    except RuntimeError as e:
        shape = (w_fp8.shape[0], x_fp8.shape[1])
        _refused.add(shape)
        logger.warning("cuBLAS refused fp8_gemm N=%d K=%d (%s); Triton runs it", *shape,
                       str(e).strip().splitlines()[0][:200])
    from flashdsa.runtime.gemm.triton.gemm import fp8_gemm as triton_gemm

    return triton_gemm(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
