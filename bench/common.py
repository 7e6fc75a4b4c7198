"""What every benchmark shares and nothing else owns: the percentile and a free local port.

``percentile`` is the one percentile of ``bench/``: linear interpolation between the closest
ranks, numpy's and ``vllm bench serve``'s default, so every benchmark's p50/p90/p99 means the
same thing. ``free_port`` is a TCP port on 127.0.0.1 that was free when asked (the caller
binds it a moment later, so another process may take it in between; benchmarks start their
own servers one at a time, which makes that rare).

How it fails: ``percentile`` of no values is 0.0 (as ``vllm bench serve`` reports an empty
series), never an error; a caller that must tell "no requests" from 0 checks for values
first. ``free_port`` lets ``OSError`` from the socket through.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (``q`` in [0, 100]) of ``values``, interpolated linearly between
    the closest ranks; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket was bound to a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
