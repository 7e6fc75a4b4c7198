"""CPUs of its own for an engine process, and the node's other serving processes kept off them.

Why: an engine's loop bounds its replica's token rate, and on a node whose cores it shares with
the processes that carry its tokens (the ingress, the replica's relays, Ray, a client) it sits
runnable but unscheduled for part of the time, each wake-up of another thread on its core
taking a step's worth of time from every request in its batch. Pinned to a core that those
processes keep off, it runs undisturbed, and they share the rest of the node's cores.

Engines claim only when their cluster asks (``ClusterConfig.engine_cpu_affinity``, off by
default: a claimed CPU stays the engine's while it idles). Claims are node-wide and need no
privilege: one lock file per CPU in ``CLAIMS_DIR``
(``/dev/shm``, one per machine or container), held with ``flock`` by the engine process for
its whole life and released by the kernel when it exits, however it exits. A claim is granted
only while at least ``MIN_SHARED_CPUS`` of the node's CPUs stay unclaimed after it (decided
under one node-wide lock, so two engines starting at once cannot take the last core between
them); otherwise the engine runs where it would have, unpinned, and logs why. Highest CPU
numbers go first, leaving CPU 0 (where interrupts usually land) to the shared set.

``keep_off_claims`` starts a daemon thread in a serving process (the ingress, an engine
replica, the index actor, the metrics hub) that every ``REFRESH_S`` reads which CPUs are
claimed and, when that changed, sets every thread of the process to the unclaimed ones (the
threads it starts later inherit them).

The node's CPUs are those the first process to import this module in a process tree may run
on (``os.sched_getaffinity``), handed to engine processes in ``NODE_CPUS_ENV``: a replica
that already keeps off the claims starts its engine process with its own narrowed set.

How it fails: never raises. Off Linux, without ``/dev/shm`` or ``flock``, or when the kernel
refuses an affinity, nothing is pinned and one line is logged; claims are an optimisation.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CLAIMS_DIR = Path(os.environ.get("PREFIXSERVE_CPU_CLAIMS_DIR", "/dev/shm/prefixserve-cpus"))
"""Where the lock files live: one folder per machine (``PREFIXSERVE_CPU_CLAIMS_DIR`` moves it,
for tests)."""
MIN_SHARED_CPUS = 1
"""CPUs that stay unclaimed on a node: the request path and Ray run there."""
REFRESH_S = 2.0
"""How often a process that keeps off the claims re-reads them (an engine starting or exiting
changes them)."""
NODE_CPUS_ENV = "PREFIXSERVE_NODE_CPUS"
"""The node's CPUs (comma-separated), set for the engine processes a replica starts."""

_START_CPUS: frozenset[int] = frozenset(
    os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
)


def node_cpus() -> frozenset[int]:
    """The CPUs this node's serving processes share: ``NODE_CPUS_ENV`` when a parent set it,
    else those this process could run on when this module was imported."""
    text = os.environ.get(NODE_CPUS_ENV, "")
    with contextlib.suppress(ValueError):
        if text:
            return frozenset(int(cpu) for cpu in text.split(","))
    return _START_CPUS


def node_cpus_env() -> dict[str, str]:
    """The environment entry an engine process needs to see the node's CPUs."""
    cpus = node_cpus()
    return {NODE_CPUS_ENV: ",".join(map(str, sorted(cpus)))} if cpus else {}


def _lock_path(cpu: int, claims_dir: Path | None = None) -> Path:
    return (CLAIMS_DIR if claims_dir is None else claims_dir) / f"cpu{cpu}"


def _is_claimed(cpu: int, claims_dir: Path) -> bool:
    """Whether some process holds ``cpu``'s lock (this one included, through another file)."""
    try:
        fd = os.open(_lock_path(cpu, claims_dir), os.O_RDONLY)
    except OSError:
        return False  # never claimed on this node
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the shared lock taken to test it
    return False


def claimed_cpus(cpus: frozenset[int], claims_dir: Path | None = None) -> frozenset[int]:
    """Which of ``cpus`` an engine process has claimed in ``claims_dir`` (default
    ``CLAIMS_DIR``; only CPUs ever claimed on this node have a lock file to test)."""
    claims_dir = CLAIMS_DIR if claims_dir is None else claims_dir
    try:
        names = os.listdir(claims_dir)
    except OSError:
        return frozenset()
    ever = {int(name[3:]) for name in names if name.startswith("cpu") and name[3:].isdigit()}
    return frozenset(cpu for cpu in ever & cpus if _is_claimed(cpu, claims_dir))


@dataclass
class Claim:
    """CPUs held by this process until it exits (or ``release``)."""

    cpus: frozenset[int]
    _fds: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def _set_threads_affinity(cpus: frozenset[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def claim_cpus(count: int, cpus: frozenset[int] | None = None) -> Claim | None:
    """Claims ``count`` of the node's CPUs (``cpus``, default ``node_cpus()``) for this process,
    leaving ``MIN_SHARED_CPUS`` unclaimed, and pins every thread of this process to them
    (threads started later inherit that). None, with a log line saying why, when that is not
    possible."""
    cpus = node_cpus() if cpus is None else cpus
    if count < 1:
        return None
    try:
        CLAIMS_DIR.mkdir(parents=True, exist_ok=True)
        guard = os.open(CLAIMS_DIR / "guard", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        log.info("engine process not pinned: cannot open %s (%r)", CLAIMS_DIR, exc)
        return None
    claim = Claim(frozenset())
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)  # one claimer at a time on the node
        taken = claimed_cpus(cpus)
        if len(cpus) - len(taken) - count < MIN_SHARED_CPUS:
            log.info(
                "engine process not pinned: %d of the node's %d CPUs are claimed, and %d more "
                "would leave fewer than %d to the request path",
                len(taken), len(cpus), count, MIN_SHARED_CPUS,
            )  # fmt: skip
            return None
        chosen = sorted(cpus - taken, reverse=True)[:count]
        for cpu in chosen:
            fd = os.open(_lock_path(cpu), os.O_RDWR | os.O_CREAT, 0o666)
            claim._fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        claim.cpus = frozenset(chosen)
        _set_threads_affinity(claim.cpus)
    except OSError as exc:
        claim.release()
        log.info("engine process not pinned: %r", exc)
        return None
    finally:
        os.close(guard)  # releases the node-wide lock
    log.info(
        "engine process pinned to CPUs %s, claimed for it alone (the node's other %d CPUs "
        "are the request path's)",
        sorted(claim.cpus), len(cpus) - len(taken) - count,
    )  # fmt: skip
    return claim


class _KeepOff:
    """The refresh thread of one process (``keep_off_claims``): it watches the claims folder
    that was ``CLAIMS_DIR`` when it started."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.claims_dir = CLAIMS_DIR
        self.applied: frozenset[int] | None = None

    def refresh(self) -> None:
        cpus = node_cpus()
        shared = cpus - claimed_cpus(cpus, self.claims_dir)
        if not shared or shared == self.applied:
            return
        try:
            _set_threads_affinity(shared)
        except OSError as exc:
            log.info("%s stays on every CPU: %r", self.role, exc)
            return
        if self.applied is not None or shared != cpus:  # not the first look at an unclaimed node
            log.info("%s runs on CPUs %s (the rest are engines')", self.role, sorted(shared))
        self.applied = shared

    def run(self) -> None:
        while True:
            time.sleep(REFRESH_S)
            with contextlib.suppress(OSError):
                self.refresh()


_keeper: _KeepOff | None = None
_keeper_lock = threading.Lock()


def keep_off_claims(role: str) -> None:
    """From now on keeps this process's threads off the CPUs engine processes claimed (once
    per process; later calls do nothing)."""
    global _keeper
    if not hasattr(os, "sched_setaffinity") or not node_cpus():
        return
    with _keeper_lock:
        if _keeper is not None:
            return
        keeper = _keeper = _KeepOff(role)
    with contextlib.suppress(OSError):
        keeper.refresh()  # now, before the caller starts its threads
    threading.Thread(target=keeper.run, name="cpu-claims", daemon=True).start()
