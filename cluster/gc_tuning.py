"""How often Python's cyclic garbage collector scans young objects in the request path.

CPython collects its youngest generation every 700 net container allocations by default,
and every tenth of those collections also scans what survived the last ten. An ingress
replica keeps each in-flight request's objects alive for the request's whole life (its
coroutines and tasks, Serve's request state, the prompt's token list), so with dozens of
requests in flight most young objects survive, and each of those scans walks the survivors
of every request again: thousands to tens of thousands of objects, several milliseconds of
CPU with the GIL held, paid by whatever code allocated at that moment. A routing decision
that happens to trigger one takes several times its own cost, which is what set the
decision's tail at dozens of replicas (``bench/README.md``, "Scale"). The
engine replica's relay holds the same kind of per-request state.

``collect_young_less_often`` raises the young generation's threshold to
``YOUNG_COLLECTION_ALLOCATIONS``: the same survivors are scanned about that many times less
often, and garbage in reference cycles waits at most that many allocations longer to be
freed. The older generations keep CPython's ratios. Serve already moves the objects a
replica's ``__init__`` left alive out of every later scan (``gc.freeze``, Serve's
``RAY_SERVE_FREEZE_GC_ON_STARTUP``), so this changes only how often the request path's own
objects are scanned.

How it fails: never; an interpreter without a cyclic collector keeps its settings.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("ray.serve")

YOUNG_COLLECTION_ALLOCATIONS = 20_000
"""Net container allocations between two collections of the youngest generation (CPython's
default is 700)."""


def collect_young_less_often(role: str) -> None:
    """Sets this process's young-generation threshold to ``YOUNG_COLLECTION_ALLOCATIONS``
    (never lowers one already higher) and logs it once, naming ``role``."""
    young, middle, old = gc.get_threshold()
    if young >= YOUNG_COLLECTION_ALLOCATIONS:
        return
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, middle, old)
    log.info(
        "%s: young objects collected every %d allocations (was %d)",
        role,
        YOUNG_COLLECTION_ALLOCATIONS,
        young,
    )
