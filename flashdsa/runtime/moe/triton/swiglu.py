"""SwiGLU ``silu(gate) * up`` (DeepSeek-V4's clipped form: ``silu(min(gate, L)) * clamp(up, -L, L)``)
as one elementwise Triton kernel, for a dense MLP or a shared expert whose gate and up come out of
one fused GEMM (two strided halves of its output, read in place).

It rounds as torch's three kernels do, so on a GPU the result is torch's bit for bit: the bound L
rounded to the tensors' dtype (torch's clamp casts its scalar), ``silu(g) = g / (1 + expf(-g))`` in
fp32 (libdevice's expf, IEEE division) rounded to the dtype, then the product rounded once. NaN
passes through the clip as torch's clamp lets it. The interpreter uses NumPy's exp (an fp32 ulp off
at times, so a bf16 result may differ by one ulp there).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from flashdsa.runtime.dispatch import interpreting
from flashdsa.runtime.moe.triton.routing import torch_exp

BLOCK = 1024  # columns a program


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, n, limit, CLIP: tl.constexpr,
                   BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    gate = tl.load(gate_ptr + t * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + t * stride_u + cols, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if CLIP:
        bound = tl.full([BLOCK], limit, tl.float32).to(dtype).to(tl.float32)  # as torch casts its scalar
        gate = tl.minimum(gate, bound, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(tl.maximum(up, -bound, propagate_nan=tl.PropagateNan.ALL), bound,
                        propagate_nan=tl.PropagateNan.ALL)
    silu = tl.math.div_rn(gate, 1.0 + torch_exp(-gate, LIBDEVICE)).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * n + cols, (silu * up).to(dtype), mask=inside)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    tokens, n = gate.shape
    out = torch.empty(tokens, n, dtype=gate.dtype, device=gate.device)
    if tokens == 0 or n == 0:
        return out
    _swiglu_kernel[(tokens, triton.cdiv(n, BLOCK))](gate, up, out, gate.stride(0), up.stride(0), n,
                                                    0.0 if limit is None else limit, CLIP=limit is not None,
                                                    BLOCK=BLOCK, LIBDEVICE=not interpreting(), num_warps=4)
    return out
