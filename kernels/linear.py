"""Linear layers on the CPU: a batch-invariant path and a fast one.

torch's CPU GEMM (MKL/oneDNN) chooses its blocking and threading by the matrix shape, so the
same input row can round differently when it is multiplied alongside 1, 7 or 300 other rows
(measured: for a 1536x576 weight, rows differ for M < 57 and for M >= 200 against M = 64).
``batch_invariant_linear`` therefore always multiplies row tiles of fixed shape
``[LINEAR_TILE_ROWS, in_features]``, zero-padding the last tile (and ``[BIG_TILE_ROWS,
in_features]`` where those are checked to round every row alike). A row's result is then a
function of that row alone: the property ``tests/kernels/test_cpu_kernels.py`` checks.

Many small GEMM calls would each re-pack the whole weight into MKL's internal layout (that
re-packing made 16 tiles of 32 rows cost 1.8x one 512-row call). ``pack_weight`` therefore
packs each float32 weight once, at load, for exactly ``LINEAR_TILE_ROWS`` rows
(``cblas_sgemm_pack`` through torch's ``mkl::_mkl_reorder_linear_weight``), and for
``BIG_TILE_ROWS`` where that is exact; every tile then runs ``cblas_sgemm_compute`` on it.
Measured on the 2-core CPU with SmolLM2's shapes, 32-row tiles: a 64-row decode step's GEMMs
139 ms packed vs 266 ms unpacked (plain: 194 ms), a 512-row prefill 803 ms vs 1386 ms
(plain: 734 ms). The packed tiles give the same bits as unpacked ``[32, K]`` matmuls. Where
MKL packing is missing (another BLAS, another dtype) the weight stays a plain tensor and
tiles use ``torch.matmul``: still batch-invariant, only slower.

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
"""Rows per GEMM call, and the padding unit. Measured on a 2-core CPU: padding to 64 makes a
single-sequence decode pay 64 rows and was no faster over a whole run."""
BIG_TILE_ROWS = 64
"""Rows per tile for the bulk of a batch of 64 rows or more, for weights whose 64-row packed
tiles compute every row to the same bits as 32-row ones (``pack_weight`` checks each weight;
MKL did for all of SmolLM2's shapes, at every tile size from 4 to 512 rows). Measured: a
64-row decode step's GEMMs 165 ms in one 64-row tile vs 194 ms in two 32-row tiles, a
512-row prefill's 1186-1254 vs 1317-1472 ms (2 threads, a busy machine). Costs one more
packed copy of each weight."""

_PROBE_SEED = 20261122


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out, in]`` float32 weight packed by MKL for tiles of each row count it holds."""

    packed: dict[int, torch.Tensor]
    """Tile rows -> MKL's opaque packed layout (an MKL-DNN tensor) for tiles of that many rows."""
    weight: torch.Tensor
    """The original weight: its shape for MKL, and its values for anything else that reads it."""

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def _packed_tiles(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, rows: int) -> list[torch.Tensor]:
    return [torch.ops.mkl._mkl_linear(x[r0 : r0 + rows], packed, weight, None, rows) for r0 in range(0, x.shape[0], rows)]


def pack_weight(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """``weight`` packed for the batch-invariant tiles when MKL can, else ``weight`` itself.

    It is packed for ``LINEAR_TILE_ROWS`` rows, and for ``BIG_TILE_ROWS`` rows too when a probe
    shows that those tiles give random rows the same bits as the small ones on this CPU."""
    usable = (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
              and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
    if not usable:
        return weight
    try:
        packed = {LINEAR_TILE_ROWS: torch.ops.mkl._mkl_reorder_linear_weight(weight, LINEAR_TILE_ROWS)}
    except RuntimeError as exc:  # a torch build without MKL-DNN tensors
        log.warning("MKL weight packing unavailable (%s); batch-invariant linear layers use unpacked tiles", exc)
        return weight
    big = torch.ops.mkl._mkl_reorder_linear_weight(weight, BIG_TILE_ROWS)
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    probe = torch.randn(BIG_TILE_ROWS, weight.shape[1], generator=gen)
    small_tiles = torch.cat(_packed_tiles(probe, packed[LINEAR_TILE_ROWS], weight, LINEAR_TILE_ROWS))
    if torch.equal(_packed_tiles(probe, big, weight, BIG_TILE_ROWS)[0], small_tiles):
        packed[BIG_TILE_ROWS] = big
    else:
        log.info("%d-row packed tiles round differently here for a %s weight: it keeps %d-row tiles",
                 BIG_TILE_ROWS, tuple(weight.shape), LINEAR_TILE_ROWS)
    return PackedWeight(packed, weight)


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
    """``x @ weight.T + bias`` computed in fixed ``[LINEAR_TILE_ROWS, K]`` tiles (and
    ``[BIG_TILE_ROWS, K]`` ones where the weight was packed for them)."""
    num_rows = x.shape[0]
    if num_rows == 0:
        return x.new_empty(0, weight.shape[0])
    tile = LINEAR_TILE_ROWS
    pad = (-num_rows) % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    x = x.contiguous()
    if isinstance(weight, PackedWeight):
        # Big tiles for the bulk, small ones for the rest (x is padded to small tiles). Bias is
        # added after the product, as in the unpacked path, so both round alike.
        big = (x.shape[0] // BIG_TILE_ROWS) * BIG_TILE_ROWS if BIG_TILE_ROWS in weight.packed else 0
        tiles = _packed_tiles(x[:big], weight.packed[BIG_TILE_ROWS], weight.weight, BIG_TILE_ROWS) if big else []
        tiles += _packed_tiles(x[big:], weight.packed[tile], weight.weight, tile)
        out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    else:
        out = x.new_empty(x.shape[0], weight.shape[0])
        for r0 in range(0, x.shape[0], tile):
            torch.matmul(x[r0 : r0 + tile], weight.t(), out=out[r0 : r0 + tile])
    if bias is not None:
        out += bias
    return out[:num_rows]
