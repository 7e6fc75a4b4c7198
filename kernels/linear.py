"""Linear layers on the CPU: a batch-invariant path and a fast one.

A CPU GEMM library picks its kernel and blocking by the matrix shape, so the same input row
can round differently when it is multiplied alongside 1, 7 or 300 other rows. The
batch-invariant path therefore multiplies row tiles of fixed shapes only, and only of shapes
proven to give a row the bits it gets in the *reference tile*, ``[LINEAR_TILE_ROWS,
in_features]``. A row's result is then a function of that row alone, whatever shares its
batch (the property ``tests/kernels/test_cpu_kernels.py`` checks).

Packing. ``pack_weight`` packs each float32 weight once, at load, into a GEMM library's own
layout, so that no call re-packs it (through torch's private ops, which only
``kernels/torch_compat.py`` names): oneDNN's blocked layout
(``mkldnn::_reorder_linear_weight``, multiplied by ``mkldnn::_linear_pointwise``: the same size
as the weight) or MKL's (``cblas_sgemm_pack`` through ``mkl::_mkl_reorder_linear_weight``,
multiplied by ``cblas_sgemm_compute``: several times the weight's size). One packed copy per
weight serves every tile size: neither layout depends on the row count (the probe checks the
products, bit for bit, rather than trusting that).

The probe. For each weight shape (a library picks kernels by shape, ISA and thread count,
never by values), ``pack_weight`` multiplies random rows in tiles of each size of
``TILE_LADDER_ROWS`` and keeps the sizes whose every row equals, bit for bit, the same row in
reference tiles; each size is compared on at least one whole reference tile, so every row
position is covered. Of the packings available it keeps the first (oneDNN, then MKL) whose
smallest exact tile is smallest: decodes need small tiles. Where no packing exists (another
dtype, a torch without MKL-DNN or MKL), the weight stays a plain tensor multiplied in
``LINEAR_TILE_ROWS``-row ``torch.matmul`` tiles. Where a probe admits nothing but the reference
size, that is what runs: slower, equally exact. ``log_tile_choices`` logs what was chosen.

Tiling a batch. ``tile_plan`` covers M rows with tiles of the proven sizes at the least
modelled cost: a tile of t rows costs like ``max(t, TILE_MIN_COST_ROWS)`` rows plus
``TILE_CALL_OVERHEAD_ROWS`` (small tiles are bound by streaming the weight, not by rows); among
plans of equal cost, the fewest padded rows. A decode of 8 rows is one 8-row tile, a 300-row
prefill 256 + 32 + 16 rows. Since every admitted size gives a row its reference-tile bits,
the plan a batch gets never changes a row's result.

``fast_linear`` (``--no-deterministic``) multiplies the whole batch in one call where the weight
is oneDNN-packed (its rounding then depends on the batch).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.torch_compat import MKL, ONEDNN, available_packings, packing_ops

log = logging.getLogger(__name__)

LINEAR_TILE_ROWS = 32
"""Rows of the reference tile, whose bits every admitted tile size must reproduce; the only
tile of unpacked weights."""
TILE_LADDER_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Tile row counts the probe tries. Small ones serve decodes; large ones the bulk of a prefill
(one call streams the weight once for many rows)."""
TILE_MIN_COST_ROWS = 16
"""``tile_plan``'s cost model: a call on fewer rows costs about as much as one on this many,
its time being spent streaming the weight (the value came from SmolLM2's shapes on a 2-core
CPU: ``bench/results/cpu_kernel_measurements.md``)."""
TILE_CALL_OVERHEAD_ROWS = 2
"""``tile_plan``'s cost model: the cost of one more call, in rows; breaks ties toward fewer
calls."""

_PROBE_SEED = 20261122


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out, in]`` float32 weight packed once, with the tile sizes proven exact for it."""

    packed: torch.Tensor
    """The library's opaque packed layout (an MKL-DNN tensor)."""
    weight: torch.Tensor
    """The original weight where the packing's multiply or the fast path reads its values (MKL);
    a meta tensor of its shape for oneDNN, whose packed copy is all it reads, so that the
    original's memory can be freed (a second copy of every weight otherwise)."""
    packing: str
    """``ONEDNN`` or ``MKL``: which library packed it, and so which one multiplies it."""
    tile_rows: tuple[int, ...]
    """Tile row counts that give every row its reference-tile bits, ascending; holds
    ``LINEAR_TILE_ROWS``."""

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def _available_packings() -> list[str]:
    """The packings this torch can run (``kernels/torch_compat.py``), oneDNN first."""
    return list(available_packings())


def probe_tile_rows(packing: str, packed: torch.Tensor, weight: torch.Tensor) -> tuple[int, ...]:
    """The sizes of ``TILE_LADDER_ROWS`` whose tiles give random rows their reference bits
    under ``packing``; each size is compared on at least one whole reference tile."""
    tile = packing_ops(packing).multiply
    probe_rows = {rows: rows * -(-LINEAR_TILE_ROWS // rows) for rows in TILE_LADDER_ROWS}
    total = -(-max(probe_rows.values()) // LINEAR_TILE_ROWS) * LINEAR_TILE_ROWS
    probe = torch.randn(
        total, weight.shape[1], generator=torch.Generator().manual_seed(_PROBE_SEED)
    )
    reference = torch.cat(
        [
            tile(probe[r0 : r0 + LINEAR_TILE_ROWS], packed, weight, LINEAR_TILE_ROWS)
            for r0 in range(0, total, LINEAR_TILE_ROWS)
        ]
    )
    exact = [LINEAR_TILE_ROWS]
    for rows, num_rows in probe_rows.items():
        if rows != LINEAR_TILE_ROWS and all(
            torch.equal(
                tile(probe[r0 : r0 + rows], packed, weight, rows), reference[r0 : r0 + rows]
            )
            for r0 in range(0, num_rows, rows)
        ):
            exact.append(rows)
    return tuple(sorted(exact))


_choice_by_shape: dict[tuple, tuple[str, tuple[int, ...]]] = {}
"""(out, in, threads) -> the packing and tile sizes the probe chose for that shape."""
_tile_choices: Counter = Counter()
"""(packing or None, tile sizes) -> weights packed so since the last ``log_tile_choices``."""
_logged: set[str] = set()


def _pack(packing: str, weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return packing_ops(packing).pack(weight, LINEAR_TILE_ROWS)
    except RuntimeError as exc:  # a build whose op exists but cannot run here
        log.debug("%s packing failed for a %s weight: %s", packing, tuple(weight.shape), exc)
        return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """``weight`` packed for the batch-invariant tiles when a library can, else ``weight``."""
    if not (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2):
        _tile_choices[(None, (LINEAR_TILE_ROWS,))] += 1
        return weight
    weight = weight.contiguous()
    key = (*weight.shape, torch.get_num_threads())
    chosen = _choice_by_shape.get(key)
    if chosen is not None:
        packed = _pack(chosen[0], weight)
    else:
        best = None  # (smallest exact tile, packing, packed, tile sizes)
        for packing in _available_packings():
            candidate = _pack(packing, weight)
            if candidate is None:
                continue
            tile_rows = probe_tile_rows(packing, candidate, weight)
            log.debug(
                "%s tiles for a %s weight: %s rows", packing, tuple(weight.shape), list(tile_rows)
            )
            if best is None or tile_rows[0] < best[0]:
                best = (tile_rows[0], packing, candidate, tile_rows)
            if best[0] == TILE_LADDER_ROWS[0]:
                break  # no packing can offer a smaller tile
        packed = None if best is None else best[2]
        if best is not None:
            chosen = _choice_by_shape[key] = (best[1], best[3])
    if packed is None:
        _tile_choices[(None, (LINEAR_TILE_ROWS,))] += 1
        return weight
    _tile_choices[chosen] += 1
    if chosen[0] == ONEDNN:
        weight = torch.empty_like(weight, device="meta")
    return PackedWeight(packed, weight, *chosen)


@functools.cache
def cpu_description() -> str:
    """``model name (ISA torch dispatches to)``, for the probes' log lines."""
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability().lower()})"


def log_tile_choices() -> str | None:
    """Logs at INFO what the probes chose for the weights packed since the last call (once per
    process for each distinct outcome), and returns the line; None if nothing was packed."""
    if not _tile_choices:
        return None
    total = sum(_tile_choices.values())
    parts = [
        f"{list(rows)} for {n}/{total} weights ({packing + '-packed' if packing else 'unpacked'})"
        for (packing, rows), n in sorted(_tile_choices.items(), key=lambda item: -item[1])
    ]
    packings = sorted({packing for packing, _ in _tile_choices if packing})
    msg = (
        f"linear tiles: probe on {cpu_description()} chose row tiles {', '.join(parts)}; "
        f"{' and '.join(packings) + ' packing on' if packings else 'weight packing off'}"
    )
    _tile_choices.clear()
    if msg not in _logged:
        _logged.add(msg)
        log.info(msg)
    return msg


def _tile_cost(rows: int) -> int:
    return max(rows, TILE_MIN_COST_ROWS) + TILE_CALL_OVERHEAD_ROWS


@functools.lru_cache(maxsize=4096)
def tile_plan(num_rows: int, tile_rows: tuple[int, ...]) -> tuple[int, ...]:
    """Tile row counts, largest first and all from ``tile_rows``, that cover ``num_rows`` rows
    at the least modelled cost; among those, the fewest padded rows, then the fewest tiles.

    The largest tile costs least per row, so all but the last two largest tiles' worth of rows
    go into largest tiles, and a small dynamic programme covers the rest."""
    if num_rows <= 0:
        return ()
    biggest = max(tile_rows)
    bulk = max(0, num_rows // biggest - 2)
    rest = num_rows - bulk * biggest
    # best[n]: (cost, rows covered, tiles, last tile) of the best cover of n rows
    best: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)]
    for n in range(1, rest + 1):
        best.append(
            min(
                (
                    best[max(0, n - t)][0] + _tile_cost(t),
                    best[max(0, n - t)][1] + t,
                    best[max(0, n - t)][2] + 1,
                    t,
                )
                for t in tile_rows
            )
        )
    tiles, n = [biggest] * bulk, rest
    while n > 0:
        tiles.append(best[n][3])
        n = max(0, n - best[n][3])
    return tuple(sorted(tiles, reverse=True))


def plain_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


FAST_PLAIN_MIN_ROWS = 256
"""``fast_linear`` on an MKL-packed weight multiplies at least this many rows in one plain GEMM,
fewer in packed tiles: packed tiles win while the weight's streaming dominates, one plain GEMM
once the rows amortise it (the crossover measured: ``bench/results/cpu_kernel_measurements.md``)."""


def fast_linear(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The non-deterministic path, where a row's rounding may depend on the batch: one oneDNN
    call on a oneDNN-packed weight; on an MKL-packed one, whichever of packed tiles and one
    plain GEMM is faster for the row count."""
    if not isinstance(weight, PackedWeight):
        return F.linear(x, weight, bias)
    if weight.packing == ONEDNN:
        if x.shape[0] == 0:
            return x.new_empty(0, weight.shape[0])
        out = packing_ops(ONEDNN).multiply(x.contiguous(), weight.packed, weight.weight, x.shape[0])
        return out if bias is None else out.add_(bias)
    if weight.packing == MKL and x.shape[0] < FAST_PLAIN_MIN_ROWS:
        return batch_invariant_linear(x, weight, bias)
    return F.linear(x, weight.weight, bias)


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` in row tiles of proven sizes (``tile_plan``), or of
    ``LINEAR_TILE_ROWS`` rows for an unpacked weight."""
    num_rows = x.shape[0]
    if num_rows == 0:
        return x.new_empty(0, weight.shape[0])
    packed = isinstance(weight, PackedWeight)
    tiles = tile_plan(num_rows, weight.tile_rows if packed else (LINEAR_TILE_ROWS,))
    pad = sum(tiles) - num_rows
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    x = x.contiguous()
    if packed:
        # Bias is added after the product, as in the unpacked path.
        tile = packing_ops(weight.packing).multiply
        outs, r0 = [], 0
        for rows in tiles:
            outs.append(tile(x[r0 : r0 + rows], weight.packed, weight.weight, rows))
            r0 += rows
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
    else:
        out = x.new_empty(x.shape[0], weight.shape[0])
        for r0 in range(0, x.shape[0], LINEAR_TILE_ROWS):
            torch.matmul(
                x[r0 : r0 + LINEAR_TILE_ROWS], weight.t(), out=out[r0 : r0 + LINEAR_TILE_ROWS]
            )
    if bias is not None:
        out += bias
    return out[:num_rows] if pad else out
