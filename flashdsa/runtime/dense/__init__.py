"""Plain linear layers (bf16/fp16/fp32 weights) at decode sizes: public function, checks, dispatch.

``dense_linear(x, weight)`` is ``x @ weight.T`` (no bias) in x's dtype, accumulated in fp32. At a
few tokens a linear layer is a GEMV bound by its weight's bytes, which cuBLAS runs as a split-K
GEMM plus a reduction kernel: DeepSeek-V4-Flash's router (256 x 4096 bf16, 2 MB) took 8 us a
call that way on an H100, where the copy rate allows under 1. The Triton GEMV reads each weight
row once in one launch.

Backends (see ``flashdsa.runtime.dispatch``): ``reference`` (``torch.nn.functional.linear``:
cuBLAS on a GPU, and the path autograd takes) and ``triton`` (CUDA, bf16/fp16, at most
``MAX_ROWS`` rows, no autograd; it declines larger batches, where cuBLAS's tensor-core GEMMs are
faster, fp32 (reference mode keeps torch's GEMM) and calls that need gradients).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.checks import check, check_tensor
from flashdsa.runtime.dispatch import Declined

__all__ = ["MAX_ROWS", "dense_linear"]

MAX_ROWS = 4  # rows (tokens) the Triton GEMV serves: a decode step's batch of one to four
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _triton_supports(rows: int = 0, grad: bool = False, dtype: torch.dtype = torch.bfloat16, **_) -> Optional[str]:
    if dtype == torch.float32:
        return Declined("triton dense_linear leaves fp32 (reference mode) to torch")
    if grad:
        return Declined("triton dense_linear has no backward")
    if rows > MAX_ROWS:
        return Declined(f"triton dense_linear serves at most {MAX_ROWS} rows, got {rows}")
    return None


dispatch.register("dense_linear", "reference", f"{__name__}.reference:dense_linear")
dispatch.register("dense_linear", "triton", f"{__name__}.triton.gemv:dense_linear", _triton_supports)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """x: [..., K] bf16/fp16/fp32 (any strides); weight: [N, K] of x's dtype on x's device, unit
    column stride. Returns ``x @ weight.T``: [..., N] in x's dtype, fp32 accumulation. No host
    sync, so it can be captured in a CUDA graph."""
    check(isinstance(x, torch.Tensor) and x.dim() >= 1, f"x must be a tensor [..., K], got {type(x).__name__}")
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (-1 cannot infer the rows when K = 0)
    check_tensor("x", x2, FLOAT_DTYPES, [None, None], "bf16/fp16/fp32 [..., K]", contiguous=False)
    check_tensor("weight", weight, x.dtype, [None, x.shape[-1]], f"[N, K={x.shape[-1]}] of x's dtype", x.device,
                 contiguous=False)
    check(weight.shape[0] == 0 or weight.stride(1) == 1, f"weight must have unit column stride, got {weight.stride()}")
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    impl = dispatch.select("dense_linear", x.device, backend, rows=x2.shape[0], grad=grad, dtype=x.dtype)
    return impl(x2, weight).view(*x.shape[:-1], weight.shape[0])
