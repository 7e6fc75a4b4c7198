"""RMSNorm (with the residual add fused in the same call), computed row by row.

The mean of squares is a per-row reduction over ``hidden_size`` elements; torch reduces the
contiguous last dimension of each row with the same vectorised loop whatever the row count,
which ``tests/kernels/test_cpu_kernels.py`` checks bitwise.
"""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rmsnorm(x + residual) * weight, x + residual)``."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x
