"""What every benchmark shares and nothing else owns: the percentile, a free local port and
SIGTERM handling.

``percentile`` is the one percentile of ``bench/``: linear interpolation between the closest
ranks, numpy's and ``vllm bench serve``'s default, so every benchmark's p50/p90/p99 means the
same thing. ``free_port`` is a TCP port on 127.0.0.1 that was free when asked (the caller
binds it a moment later, so another process may take it in between; benchmarks start their
own servers one at a time, which makes that rare).

``sigterm_unwinds`` makes a SIGTERM unwind the benchmark like Ctrl-C (``SystemExit`` 143 at
the point it arrives), so the ``finally`` blocks that stop the servers it started run; on a
thread other than the main one (where signals cannot be handled) it does nothing.

How it fails: ``percentile`` of no values is 0.0 (as ``vllm bench serve`` reports an empty
series), never an error; a caller that must tell "no requests" from 0 checks for values
first. ``free_port`` lets ``OSError`` from the socket through.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence


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


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``SystemExit(143)`` (the previous handler comes
    back after it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
