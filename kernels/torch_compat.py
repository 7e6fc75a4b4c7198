"""The one place that names torch's private CPU GEMM ops, which ``kernels/linear.py`` packs with.

torch has no public API to pack a weight once and multiply row tiles by the packed copy; its
inductor CPU backend does it through underscore ops, which any release may rename or change:

- oneDNN: ``torch.ops.mkldnn._reorder_linear_weight(weight)`` packs,
  ``torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")`` multiplies;
- MKL: ``torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)`` packs (``cblas_sgemm_pack``),
  ``torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)`` multiplies.

``TESTED_TORCH`` is the range these were checked against; it matches the bound in
``pyproject.toml`` (``tests/test_private_apis.py`` keeps them equal and checks the ops exist).

How it fails: a torch build without MKL-DNN or MKL (``torch.backends.*.is_available()``) has
no packing, and ``kernels/linear.py`` multiplies plain tiles (exact, slower), as designed. A
build whose library is there but whose ops are not (a torch outside ``TESTED_TORCH`` that
renamed them) gets the same fallback plus one warning naming the installed torch, the
missing ops and the tested range; ``packing_ops`` raises ``RuntimeError`` with that message
for a packing whose ops are missing, so no caller reaches a bare ``AttributeError``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TESTED_TORCH = ">=2.4,<2.14"
"""torch versions whose private packing ops this module was checked against."""

ONEDNN, MKL = "oneDNN", "MKL"

_OPS = {
    ONEDNN: ("mkldnn", ("_reorder_linear_weight", "_linear_pointwise")),
    MKL: ("mkl", ("_mkl_reorder_linear_weight", "_mkl_linear")),
}
"""Packing -> (``torch.ops`` namespace, the ops it needs)."""


@dataclass(frozen=True)
class PackingOps:
    """One library's pack and multiply, with linear's signatures."""

    pack: Callable[[torch.Tensor, int], torch.Tensor]
    """``pack(weight [out, in], tile_rows)`` -> the library's opaque packed tensor."""
    multiply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
    """``multiply(x [rows, in], packed, weight, rows)`` -> ``x @ weight.T`` (no bias)."""


def _library_available(packing: str) -> bool:
    backend = torch.backends.mkldnn if packing == ONEDNN else torch.backends.mkl
    return bool(backend.is_available())


def missing_ops(packing: str) -> list[str]:
    """``torch.ops`` names ``packing`` needs that this torch lacks; empty when all exist."""
    namespace, names = _OPS[packing]
    ops = getattr(torch.ops, namespace)
    return [f"torch.ops.{namespace}.{name}" for name in names if not hasattr(ops, name)]


def missing_message(packing: str, missing: list[str]) -> str:
    """The error for ``packing``'s ``missing`` ops: what, the installed torch, the range."""
    return (
        f"torch {torch.__version__} has {packing} but not {', '.join(missing)}, which "
        f"kernels/linear.py packs weights with (tested with torch{TESTED_TORCH})"
    )


@functools.cache
def packing_ops(packing: str) -> PackingOps:
    """The pack and multiply of ``packing`` (``ONEDNN`` or ``MKL``); ``RuntimeError`` naming
    the installed torch and ``TESTED_TORCH`` if this torch lacks them."""
    missing = missing_ops(packing)
    if missing:
        raise RuntimeError(missing_message(packing, missing))
    if packing == ONEDNN:
        onednn = torch.ops.mkldnn
        reorder, pointwise = onednn._reorder_linear_weight, onednn._linear_pointwise
        return PackingOps(
            pack=lambda weight, rows: reorder(weight),
            multiply=lambda x, packed, weight, rows: pointwise(x, packed, None, "none", [], ""),
        )
    reorder, mkl_linear = torch.ops.mkl._mkl_reorder_linear_weight, torch.ops.mkl._mkl_linear
    return PackingOps(
        pack=lambda weight, rows: reorder(weight, rows),
        multiply=lambda x, packed, weight, rows: mkl_linear(x, packed, weight, None, rows),
    )


@functools.cache
def available_packings() -> tuple[str, ...]:
    """The packings this torch build can run, oneDNN first; checked once per process. A
    library present without its ops is left out with one warning."""
    found = []
    for packing in (ONEDNN, MKL):
        if not _library_available(packing):
            continue
        missing = missing_ops(packing)
        if missing:
            log.warning("%s; its linear layers use plain tiles", missing_message(packing, missing))
            continue
        found.append(packing)
    return tuple(found)
