"""FP8 block-scaled GEMM (DeepSeek-V3 style) and its quantizers: public functions, checks, dispatch.

Weights are e4m3 with one fp32 scale per 128x128 block (``weight_scale_inv`` in the official
checkpoints: ``w ~= w_fp8 * w_scale[n // 128, k // 128]``). Activations are quantized on the fly
to e4m3 with one fp32 scale per token and 128 channels (``x ~= x_fp8 * x_scale[m, k // 128]``);
DeepSeek-V3.2 uses power-of-two scales there (``scale_fmt: ue8m0``). The product accumulates in
fp32. A last group narrower than 128 (K or N not a multiple of 128) is scaled by its own amax.

Backends (see ``flashdsa.runtime.dispatch``): ``reference`` (torch, any device: dequantizes the
operands of each call, never a whole model), ``triton`` (CUDA; the GEMM needs FP8 tensor cores,
compute capability >= 8.9, the quantizer any CUDA GPU) and, for the GEMM at M >= 256 (prefill),
``cublas`` (``torch._scaled_mm`` with blockwise scales, Hopper onwards, probed once per device;
``cublas.py`` says which shapes it takes). The Triton GEMM picks its launch shape
from (M, N, K) alone (``triton/configs.py``): nothing is timed at run time, so every call can be
captured in a CUDA graph. Neither op reads a device value back to the host.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.checks import check, check_tensor
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import reference
from flashdsa.runtime.gemm.reference import GROUP

__all__ = ["GROUP", "quantize_activations", "quantize_weight", "dequantize_weight", "fp8_gemm", "fp8_gemm_backend",
           "fp8_linear"]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

FP8_CAPABILITY = (8, 9)  # e4m3 tensor-core dots: Ada and Hopper onwards


def _triton_gemm_supports(capability: Optional[tuple[int, int]] = None, **_) -> Optional[str]:
    """Why the Triton GEMM cannot run on this device, or None (capability None: no CUDA device,
    e.g. the CPU interpreter)."""
    if capability is not None and capability < FP8_CAPABILITY:
        return f"triton fp8_gemm needs FP8 tensor cores (compute capability >= 8.9), got {capability}"
    return None


def _cublas_gemm_supports(**facts) -> Optional[str]:
    from flashdsa.runtime.gemm.cublas import supports  # imported on first use, like the backends

    return supports(**facts)


for _op in ("quantize_activations", "fp8_gemm"):
    dispatch.register(_op, "reference", f"{__name__}.reference:{_op}")
dispatch.register("quantize_activations", "triton", f"{__name__}.triton.quantize:quantize_activations")
dispatch.register("fp8_gemm", "triton", f"{__name__}.triton.gemm:fp8_gemm", supports=_triton_gemm_supports)
# cuBLAS's answer changes as the process runs: once per device it is probed (declining while a CUDA
# graph is captured before that), and a shape it refuses at run time goes to Triton from then on.
dispatch.register("fp8_gemm", "cublas", f"{__name__}.cublas:fp8_gemm", supports=_cublas_gemm_supports, stable=False)


def _groups(n: int) -> int:
    return -(-n // GROUP)


def quantize_activations(x: torch.Tensor, *, pow2_scales: bool = False,
                         backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x: [M, K]`` bf16/fp16/fp32 (any strides) per token and 128 channels.

    Returns ``(x_fp8: [M, K] e4m3, x_scale: [M, ceil(K/128)] fp32)`` with ``x ~= x_fp8 * x_scale``,
    ``scale = amax / 448`` (amax clamped at 1e-4) over each group of 128 channels (the last one
    possibly narrower), rounded up to a power of two with ``pow2_scales``; values are divided by
    the scale, clamped to +-448 and rounded to nearest even. Both backends give the same bytes.
    """
    check_tensor("x", x, FLOAT_DTYPES, [None, None], "bf16/fp16/fp32 [M, K]", contiguous=False)
    check(x.shape[1] > 0, f"x must have K > 0, got {list(x.shape)}")
    impl = dispatch.select("quantize_activations", x.device, backend)
    return impl(x, pow2_scales)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w: [N, K]`` float to e4m3 with one ``amax / 448`` scale per 128x128 block, the
    official checkpoints' format: returns ``(w_fp8: [N, K], w_scale: [ceil(N/128), ceil(K/128)] fp32)``."""
    check_tensor("w", w, FLOAT_DTYPES, [None, None], "bf16/fp16/fp32 [N, K]")
    return reference.quantize_weight(w)


def dequantize_weight(w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``w_fp8: [N, K]`` e4m3 times its block scales ``[ceil(N/128), ceil(K/128)]`` -> fp32 ``[N, K]``
    (reference mode, and layers that absorb the weight into another product)."""
    check_tensor("w_fp8", w_fp8, E4M3, [None, None], "float8_e4m3fn [N, K]")
    n, k = w_fp8.shape
    check_tensor("w_scale", w_scale, torch.float32, [_groups(n), _groups(k)],
                 f"fp32 [ceil(N/128)={_groups(n)}, ceil(K/128)={_groups(k)}]", w_fp8.device)
    from flashdsa.runtime.gemm.reference import dequantize_weight as impl

    return impl(w_fp8, w_scale)


def _check_gemm(x_fp8, x_scale, w_fp8, w_scale) -> None:
    check_tensor("x_fp8", x_fp8, E4M3, [None, None], "float8_e4m3fn [M, K]")
    m, k = x_fp8.shape
    device = x_fp8.device
    check_tensor("x_scale", x_scale, torch.float32, [m, _groups(k)], f"fp32 [M={m}, ceil(K/128)={_groups(k)}]", device)
    _check_weight(w_fp8, w_scale, k, device)


def _check_weight(w_fp8, w_scale, k: int, device: torch.device) -> None:
    check_tensor("w_fp8", w_fp8, E4M3, [None, k], f"float8_e4m3fn [N, K={k}]", device)
    n = w_fp8.shape[0]
    check_tensor("w_scale", w_scale, torch.float32, [_groups(n), _groups(k)],
                 f"fp32 [ceil(N/128)={_groups(n)}, ceil(K/128)={_groups(k)}]", device)


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, *, backend: Optional[str] = None) -> torch.Tensor:
    """``y = dequant(x_fp8, x_scale) @ dequant(w_fp8, w_scale)^T`` with fp32 accumulation.

    x_fp8: [M, K] e4m3, x_scale: [M, ceil(K/128)] fp32 (from :func:`quantize_activations`);
    w_fp8: [N, K] e4m3, w_scale: [ceil(N/128), ceil(K/128)] fp32. Returns [M, N] ``out_dtype``
    (bf16, fp16 or fp32).
    """
    _check_gemm(x_fp8, x_scale, w_fp8, w_scale)
    check(out_dtype in FLOAT_DTYPES, f"out_dtype must be one of bf16/fp16/fp32, got {out_dtype}")
    impl = dispatch.select("fp8_gemm", x_fp8.device, backend,
                           **_gemm_facts(x_fp8.shape[0], w_fp8.shape[0], x_fp8.shape[1], x_fp8.device, out_dtype))
    return impl(x_fp8, x_scale, w_fp8, w_scale, out_dtype)


def _gemm_facts(m: int, n: int, k: int, device: torch.device, out_dtype: torch.dtype) -> dict:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return dict(on=device, capability=capability, m=m, n=n, k=k, out_dtype=out_dtype)


def fp8_gemm_backend(m: int, n: int, k: int, device: torch.device, out_dtype: torch.dtype = torch.bfloat16, *,
                     backend: Optional[str] = None) -> str:
    """The backend :func:`fp8_gemm` runs ``[m, k] x [n, k]^T -> out_dtype`` on ``device`` with (benchmarks
    name it in their rows)."""
    device = torch.device(device)
    return dispatch.choose("fp8_gemm", device, backend, **_gemm_facts(m, n, k, device, out_dtype))


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, *, groups: int = 1,
               pow2_scales: bool = False, backend: Optional[str] = None) -> torch.Tensor:
    """``x: [..., K]`` float through the block-scaled e4m3 weight ``w_fp8: [N, K]`` -> ``[..., N]`` in x's dtype:
    :func:`quantize_activations` then :func:`fp8_gemm` (:func:`composed_linear`). At 1..4 tokens on
    an H100/H200 that is the native decode GEMV (``cuda/gemv.py``: one launch); elsewhere, where both
    run on Triton and one launch pays (:func:`one_launch_pays`: a few tokens through a small weight),
    one Triton kernel (``triton/gemm.py``) with the same bits.

    ``groups`` > 1 is a grouped projection (DeepSeek-V4's ``wo_a``): ``x: [..., groups * K]`` and
    ``w_fp8: [groups * N, K]`` (K and N multiples of 128), group g's K inputs through the weight rows
    ``[g N, (g + 1) N)`` -> ``[..., groups * N]``; natively and on Triton all groups run in one
    launch, on the other backends group by group."""
    check(isinstance(x, torch.Tensor) and x.dim() >= 1, f"x must be a tensor [..., K], got {type(x).__name__}")
    check(isinstance(groups, int) and groups >= 1, f"groups must be an int >= 1, got {groups!r}")
    x2 = x.reshape(-1, x.shape[-1])
    check_tensor("x", x2, FLOAT_DTYPES, [None, None], "bf16/fp16/fp32 [..., K]", contiguous=False)
    check(x2.shape[1] > 0 and x2.shape[1] % groups == 0,
          f"x must have K > 0 features a group ({groups} groups), got {list(x.shape)}")
    k = x2.shape[1] // groups
    _check_weight(w_fp8, w_scale, k, x2.device)
    check(groups == 1 or (w_fp8.shape[0] % groups == 0 and (w_fp8.shape[0] // groups) % GROUP == 0 and k % GROUP == 0),
          f"a grouped w_fp8 must have groups ({groups}) x N rows, N and K multiples of {GROUP}, got {list(w_fp8.shape)}")
    device = x2.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    impl = dispatch.select("fp8_linear", device, backend, m=x2.shape[0], n=w_fp8.shape[0], k=k, groups=groups,
                           capability=capability)
    return impl(x2, w_fp8, w_scale, groups, pow2_scales, backend).view(*x.shape[:-1], w_fp8.shape[0])


def composed_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, groups: int, pow2_scales: bool,
                    backend: Optional[str]) -> torch.Tensor:
    """:func:`fp8_linear` (arguments checked there; x: [M, groups * K]) as the quantizer and the GEMM
    of ``backend`` (None: each op's automatic choice): its ``triton`` and ``reference`` backends."""
    m, k = x.shape[0], x.shape[1] // groups
    n = w_fp8.shape[0] // groups
    if groups > 1 and fp8_gemm_backend(m, n, k, x.device, x.dtype, backend=backend) != "triton":
        return torch.cat([composed_linear(x[:, g * k:(g + 1) * k], w_fp8[g * n:(g + 1) * n],
                                          w_scale[g * n // GROUP:(g + 1) * n // GROUP], 1, pow2_scales, backend)
                          for g in range(groups)], dim=1)
    if _one_launch(x, w_fp8, k, backend):
        from flashdsa.runtime.gemm.triton.gemm import fp8_linear as impl

        return impl(x, w_fp8, w_scale, pow2_scales, x.dtype, groups=groups)
    x_fp8, x_scale = quantize_activations(x, pow2_scales=pow2_scales, backend=backend)
    if groups == 1:
        return fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, x.dtype, backend=backend)
    from flashdsa.runtime.gemm.triton.gemm import fp8_gemm as grouped

    return grouped(x_fp8, x_scale, w_fp8, w_scale, x.dtype, groups=groups)


def _native_linear_supports(m: int = 0, n: int = 0, k: int = 0, groups: int = 1,
                            capability: Optional[tuple[int, int]] = None, **_) -> Optional[str]:
    """The native GEMV's support check (``cuda/__init__.py``), declining (not refusing) the calls it
    leaves to the composed path: a forced ``cuda`` backend still runs them there."""
    from flashdsa.runtime.gemm.cuda import supports

    reason = supports(m, n, k, groups, capability)
    return None if reason is None else dispatch.Declined(reason)


dispatch.register("fp8_linear", "cuda", f"{__name__}.cuda.gemv:fp8_linear", supports=_native_linear_supports)
for _backend in ("triton", "reference"):
    dispatch.register("fp8_linear", _backend, f"{__name__}:composed_linear")


ONE_LAUNCH_MAX_M = 4
ONE_LAUNCH_MAX_WEIGHT_BYTES = 6 << 20


def one_launch_pays(m: int, n: int, k: int) -> bool:
    """Whether the one-launch linear beats quantize + GEMM (+ split sum) at ``[m, k] x [n, k]^T``.
    Measured on an H100 (``bench_gemm.py --one-launch``, every program re-quantizing its activation
    tile in integer arithmetic): 1.1-1.2x for e4m3 weights of 0.9-4 MB at 1-4 tokens, where the
    launches it saves dominate; 0.8-0.99x from 11 MB up and 0.6-0.9x at 32 tokens."""
    return 0 < m <= ONE_LAUNCH_MAX_M and n * k <= ONE_LAUNCH_MAX_WEIGHT_BYTES


def _one_launch(x: torch.Tensor, w_fp8: torch.Tensor, k: int, backend: Optional[str]) -> bool:
    """Whether :func:`fp8_linear` runs as the one Triton kernel: it pays at this shape
    (:func:`one_launch_pays`, all groups' weights together) and both ops chose Triton."""
    m, n = x.shape[0], w_fp8.shape[0]
    if not one_launch_pays(m, n, k) or fp8_gemm_backend(m, n, k, x.device, x.dtype, backend=backend) != "triton":
        return False
    return dispatch.choose("quantize_activations", x.device, backend) == "triton"
