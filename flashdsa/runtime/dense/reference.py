"""dense_linear in torch: ``F.linear`` (cuBLAS on a GPU; differentiable)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> [M, N] in x's dtype."""
    return F.linear(x, weight)
