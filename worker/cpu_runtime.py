"""Process-wide CPU settings the engine applies before it loads a model.

``configure_cpu_allocator`` raises glibc malloc's mmap and trim thresholds. By default glibc
serves an allocation above its mmap threshold (128 KiB at first, adapting up to 32 MiB) with a
fresh ``mmap`` and unmaps it on free, so every step's multi-MB activations (score tiles,
gathered keys, GEMM outputs) fault their pages in again, 30 layers a step. With the
thresholds raised, freed blocks stay in malloc's heap and the next step reuses them: on the
engine benchmark's workload (``bench/engine.py``, 2 threads) 77.0 -> 81.3 output tokens/s.
The cost is that the process keeps its peak heap instead of returning it to the system, as
a caching allocator would.

Where there is no glibc (musl, macOS) it does nothing and says so at debug level; it never
raises, since the engine runs the same without it, only slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc's largest allowed mmap threshold on 64-bit: allocations up to it come from the heap."""
TRIM_THRESHOLD_BYTES = 2**30
"""Free heap kept before glibc gives memory back to the system."""

_configured = False


def configure_cpu_allocator() -> bool:
    """Raises glibc's mmap/trim thresholds once per process; True if they were set."""
    global _configured
    if _configured:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("no glibc mallopt (%s): keeping the default allocator settings", name)
        return False
    ok = (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
    if not ok:
        log.debug("mallopt refused the thresholds: keeping the default allocator settings")
    _configured = ok
    return ok
