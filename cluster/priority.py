"""CPU priority of the serving processes off the request path: they yield the cores.

Why: on a machine whose cores the engines use in full (the default CPU setup: one replica's
torch threads on every core), the background work of a cluster (the metrics hub, Serve's
controller, Ray's GCS, agents and log monitor) preempts the engine's torch threads
mid-operation, and the other thread of the operation spins until the preempted one is back.
Below the engines, it runs when they wait. The request path stays at the engines' priority:
the proxy, the ingress, the replicas' relays and the index actor admit the next request and
carry every token, and starving them starves the engine's batch (``docs/design.md``,
Decisions, has the measurement).

Only raising a nice value is done (any process may do that to its own threads and to the
processes of its user), so the engines, started at Ray's worker niceness (0 for a local
cluster, Ray's default 15 elsewhere), keep theirs (unless ``EngineConfig.engine_nice`` has
an engine process ask to run above them, ``worker/engine_process.py``); the background goes
``support_nice`` steps below it, as ``nice -n`` counts (capped at 19). On Linux
``setpriority`` acts on one thread, so each call here walks ``/proc/<pid>/task``; threads
started later inherit the priority of the thread that starts them.

How it fails: never. Elsewhere than Linux, for a process or thread that is gone, or when the
kernel refuses, nothing changes and a DEBUG line says why; priorities are an optimisation.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SUPPORT_NICE_DEFAULT = 10
"""Nice steps below the engines of the background processes (``ClusterConfig.support_nice``)."""
MAX_NICE = 19

RAY_SYSTEM_PROCESS_MARKERS = (
    "gcs_server",
    "ray::ServeController",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
    "log_monitor.py",
    "monitor.py",
)
"""What identifies, in its first ``MARKER_ARGS`` command-line words (Ray workers show their
actor's name there), a background process of a local Ray cluster. Not the raylet (the worker
processes it starts, engine replicas included, inherit its priority), nor the request path
(``ray::ProxyActor``, the replicas, ``ray::IndexActor``)."""
MARKER_ARGS = 3


def _thread_ids(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def lower_priority(pid: int, nice: int) -> int:
    """Raises every thread of ``pid`` to at least ``nice`` (never lowers one); returns how
    many threads changed. ``nice`` <= 0 changes nothing."""
    nice = min(nice, MAX_NICE)
    if nice <= 0:
        return 0
    changed = 0
    for tid in _thread_ids(pid):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError as exc:  # the thread ended, or the kernel refused
            log.debug("could not lower the priority of thread %d of %d: %r", tid, pid, exc)
    return changed


def lower_own_priority(steps: int, role: str) -> None:
    """Lowers this process (every thread it has now) ``steps`` nice values below the thread
    calling this, as ``nice -n steps`` would have started it; logs it once. In a Ray worker
    (the metrics hub) that is ``steps`` below the engines, which Ray starts at the same
    niceness."""
    if steps <= 0:
        return
    nice = min(os.getpriority(os.PRIO_PROCESS, 0) + steps, MAX_NICE)
    if lower_priority(os.getpid(), nice):
        log.info("%s runs at nice %d, below the engines", role, nice)


def _command_words(pid: int) -> str:
    """The first ``MARKER_ARGS`` words of ``pid``'s command line (a raylet's later arguments
    name the agents it starts)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:MARKER_ARGS]
    except OSError:
        return ""
    return " ".join(w.decode(errors="replace") for w in words)


def _parent_of(pid: int) -> int | None:
    try:  # the parent is the 2nd field after the parenthesised name (which may hold spaces)
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (a snapshot of ``/proc``; processes may end meanwhile)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            parent = _parent_of(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found: list[int] = []
    stack = list(children.get(pid, ()))
    while stack:
        child = stack.pop()
        found.append(child)
        stack += children.get(child, ())
    return found


def lower_ray_system_priority(steps: int, root_pid: int | None = None) -> list[int]:
    """Lowers the background Ray processes below ``root_pid`` (this process by default: the
    driver that started a local Ray, at this thread's niceness) ``steps`` nice values below
    this thread; returns the pids it changed (none when called again)."""
    if steps <= 0:
        return []
    nice = min(os.getpriority(os.PRIO_PROCESS, 0) + steps, MAX_NICE)
    changed = []
    for pid in descendants(root_pid or os.getpid()):
        words = _command_words(pid)
        is_ray_system = "raylet" not in words and any(
            marker in words for marker in RAY_SYSTEM_PROCESS_MARKERS
        )
        if is_ray_system and lower_priority(pid, nice):
            changed.append(pid)
    return changed
