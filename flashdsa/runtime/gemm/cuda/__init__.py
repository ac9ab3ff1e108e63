"""Native Hopper kernels of the FP8 GEMM (CUDA C++; built on first use by ``flashdsa.runtime.native``):
the decode GEMV of ``gemv.py``. Its support check lives here, so dispatch can ask it without
building the extension."""

from __future__ import annotations

from typing import Optional

from flashdsa.runtime.gemm.reference import GROUP

SM90 = (9, 0)  # mma.sync, clusters and the e4m3 conversions, built for sm_90a only
MAX_M = 4  # tokens: the kernel's shared-memory token slots (the MMA's N is 8)
MAX_K = 32768  # inputs per group: a cluster of at most 8 CTAs, 32 blocks of 128 each


def supports(m: int, n_total: int, k: int, groups: int, capability: Optional[tuple[int, int]]) -> Optional[str]:
    """Why the native GEMV cannot take ``x: [m, groups*k] @ w: [n_total, k]^T`` (``n_total = groups*N``)
    on a device of ``capability`` (None: no CUDA device), or None when it can."""
    if capability is None or tuple(capability) != SM90:
        return f"the native fp8 GEMV needs an SM90 GPU (H100/H200), got compute capability {capability}"
    if not 1 <= m <= MAX_M:
        return f"the native fp8 GEMV takes 1 to {MAX_M} tokens, got M={m}"
    if k % GROUP or not GROUP <= k <= MAX_K:
        return f"the native fp8 GEMV needs K a multiple of {GROUP} in [{GROUP}, {MAX_K}], got K={k}"
    if groups < 1 or n_total < groups or n_total % groups:
        return f"the native fp8 GEMV needs groups >= 1 dividing the {n_total} weight rows, got groups={groups}"
    if groups > 1 and (n_total // groups) % GROUP:
        return f"the grouped native fp8 GEMV needs N a multiple of {GROUP}, got N={n_total // groups}"
    return None
