"""What every benchmark shares and nothing else owns: the percentile, a free local port,
SIGTERM handling and the warm-up retry.

``percentile`` is the one percentile of ``bench/``: linear interpolation between the closest
ranks, numpy's and ``vllm bench serve``'s default, so every benchmark's p50/p90/p99 means the
same thing. ``free_port`` (``free_ports``: several distinct ones) is a TCP port on 127.0.0.1
that was free when asked and that this process never handed out before (the caller binds it a
moment later, so another process may take it in between; benchmarks and tests start their
servers one at a time, which makes that rare). A port from an earlier call is never given again:
the OS hands a just-closed port out again, so two draws for one cluster (its head's ports, then
each node's) could otherwise collide.

``sigterm_unwinds`` makes a SIGTERM unwind the benchmark like Ctrl-C (``SystemExit`` 143 at
the point it arrives), so the ``finally`` blocks that stop the servers it started run; on a
thread other than the main one (where signals cannot be handled) it does nothing.

``retry_until_served`` sends a burst of warm-up requests until all succeed (a server may
answer ``/health`` before it can route), and raises ``RuntimeError`` with the first failure
once its patience runs out.

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
import time
from collections.abc import Callable, Iterator, Sequence


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
    return free_ports(1)[0]


# Every port free_ports handed out in this process (guarded by the lock: tests draw from threads).
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_ports(count: int) -> list[int]:
    """``count`` distinct such ports: held open together, so none repeats, and none that an
    earlier call returned."""
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        with _HANDED_OUT_LOCK:
            while len(ports) < count:
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
                if port not in _HANDED_OUT:
                    ports.append(port)
            _HANDED_OUT.update(ports)
        return ports
    finally:
        for sock in sockets:
            sock.close()


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


def retry_until_served(
    send: Callable[[], list[dict]], patience_s: float, interval_s: float = 2.0
) -> None:
    """Call ``send`` (one burst of requests; their records, each with ``success`` and
    ``error``) every ``interval_s`` until every request of a burst succeeds."""
    deadline = time.monotonic() + patience_s
    while True:
        records = send()
        bad = [r["error"] for r in records if not r["success"]]
        if not bad:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"warm-up: {len(bad)} of {len(records)} requests failed, first: {bad[0]}"
            )
        time.sleep(interval_s)
