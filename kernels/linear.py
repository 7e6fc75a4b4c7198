"""Linear layers on the CPU: a batch-invariant path and a fast one.

torch's CPU GEMM (MKL/oneDNN) chooses its blocking and threading by the matrix shape, so the
same input row can round differently when it is multiplied alongside 1, 7 or 300 other rows
(measured: for a 1536x576 weight, rows differ for M < 57 and for M >= 200 against M = 64).
``batch_invariant_linear`` therefore always multiplies row tiles of one fixed shape
``[LINEAR_TILE_ROWS, in_features]``, zero-padding the last tile. A row's result is then a
function of that row alone: the property ``tests/kernels/test_cpu_kernels.py`` checks.

Many small GEMM calls would each re-pack the whole weight into MKL's internal layout (that
re-packing made 16 tiles of 32 rows cost 1.8x one 512-row call). ``pack_weight`` therefore
packs each float32 weight once, at load, for exactly ``LINEAR_TILE_ROWS`` rows
(``cblas_sgemm_pack`` through torch's ``mkl::_mkl_reorder_linear_weight``); every tile then
runs ``cblas_sgemm_compute`` on it. Measured on the 2-core CPU with SmolLM2's shapes: a
64-row decode step's GEMMs 139 ms packed vs 266 ms unpacked tiles (plain: 194 ms), a 512-row
prefill 803 ms vs 1386 ms (plain: 734 ms). The packed tiles give the same bits as unpacked
``[32, K]`` matmuls. Where MKL packing is missing (another BLAS, another dtype) the weight
stays a plain tensor and tiles use ``torch.matmul``: still batch-invariant, only slower.

``fast_linear`` (``--no-deterministic``) takes packed tiles below ``FAST_PLAIN_MIN_ROWS``
rows and one plain GEMM above, whichever was measured faster.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

LINEAR_TILE_ROWS = 32
"""Rows per GEMM call. Measured on a 2-core CPU: 64 makes a single-sequence decode pad 64x
and was no faster over a whole run; 32 keeps both batch sizes cheap once weights are packed."""


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out, in]`` float32 weight packed by MKL for ``[LINEAR_TILE_ROWS, in]`` inputs."""

    packed: torch.Tensor
    """MKL's opaque packed layout (an MKL-DNN tensor)."""
    weight: torch.Tensor
    """The original weight: its shape for MKL, and its values for anything else that reads it."""

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def pack_weight(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """``weight`` packed for the batch-invariant tiles when MKL can, else ``weight`` itself."""
    usable = (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
              and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
    if not usable:
        return weight
    try:
        return PackedWeight(torch.ops.mkl._mkl_reorder_linear_weight(weight, LINEAR_TILE_ROWS), weight)
    except RuntimeError as exc:  # a torch build without MKL-DNN tensors
        log.warning("MKL weight packing unavailable (%s); batch-invariant linear layers use unpacked tiles", exc)
        return weight


FAST_PLAIN_MIN_ROWS = 256
"""``fast_linear`` multiplies at least this many rows in one plain GEMM, fewer in packed tiles
(measured with SmolLM2's shapes: packed tiles 139 vs plain 194 ms at 64 rows, 803 vs 734 ms
at 512 rows)."""


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def fast_linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The non-deterministic path: whichever of packed tiles and one plain GEMM is faster for
    the row count, so a row's rounding depends on the batch."""
    if not isinstance(weight, PackedWeight):
        return F.linear(x, weight, bias)
    if x.shape[0] >= FAST_PLAIN_MIN_ROWS:
        return F.linear(x, weight.weight, bias)
    return batch_invariant_linear(x, weight, bias)


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` computed in fixed ``[LINEAR_TILE_ROWS, K]`` tiles."""
    num_rows = x.shape[0]
    tile = LINEAR_TILE_ROWS
    pad = (-num_rows) % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    x = x.contiguous()
    if isinstance(weight, PackedWeight):
        # Bias is added after the product, as in the unpacked path, so both round alike.
        tiles = [torch.ops.mkl._mkl_linear(x[r0 : r0 + tile], weight.packed, weight.weight, None, tile)
                 for r0 in range(0, x.shape[0], tile)]
        out = tiles[0] if len(tiles) == 1 else torch.cat(tiles) if tiles else x.new_empty(0, weight.shape[0])
    else:
        out = x.new_empty(x.shape[0], weight.shape[0])
        for r0 in range(0, x.shape[0], tile):
            torch.matmul(x[r0 : r0 + tile], weight.t(), out=out[r0 : r0 + tile])
    if bias is not None:
        out += bias
    return out[:num_rows]
