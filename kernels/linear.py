"""Linear layers on the CPU: a batch-invariant path and the plain one.

torch's CPU GEMM (MKL/oneDNN) chooses its blocking and threading by the matrix shape, so the
same input row can round differently when it is multiplied alongside 1, 7 or 300 other rows
(measured: for a 1536x576 weight, rows differ for M < 57 and for M >= 200 against M = 64).
``batch_invariant_linear`` therefore always multiplies row tiles of one fixed shape
``[LINEAR_TILE_ROWS, in_features]``, zero-padding the last tile. A row's result is then a
function of that row alone: the property ``tests/kernels/test_cpu_kernels.py`` checks.

The cost is padding (a decode of one sequence pays for a full tile) and one GEMM call per
tile; ``bench/determinism.py`` measures it against ``plain_linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LINEAR_TILE_ROWS = 32
"""Rows per GEMM call. Measured on a 2-core CPU: 32 costs ~1.4x plain at 64 rows and pads a
single decode 32x; 64 is ~1.05x at 64 rows but doubles single-sequence decode latency again."""


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` computed in fixed ``[LINEAR_TILE_ROWS, K]`` tiles."""
    num_rows = x.shape[0]
    tile = LINEAR_TILE_ROWS
    pad = (-num_rows) % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = x.new_empty(x.shape[0], weight.shape[0])
    for r0 in range(0, x.shape[0], tile):
        torch.matmul(x[r0 : r0 + tile], weight.t(), out=out[r0 : r0 + tile])
    if bias is not None:
        out += bias
    return out[:num_rows]
