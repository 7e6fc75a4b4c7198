"""The tiny cluster's background runs below its engines, its request path beside them, and
its engines on CPUs of their own.

The metrics hub lowers itself ``ClusterConfig.support_nice`` steps (10 by default) below the
niceness Ray starts its workers at (``cluster/priority.py``); the engine processes keep it
(``EngineConfig.engine_nice`` is unset by default), and so do the ingress and the engine
replicas' relays, which carry every request and token. An engine process claims a CPU of its
own while one stays unclaimed (``worker/cpu_claims.py``), and the ingress, the relays and the
hub keep off it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import pytest

from cluster.priority import descendants
from tests.cluster.conftest import REUSE_ENV
from worker import cpu_claims


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def nices(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_only_the_background_runs_below_the_engines(tiny_server):
    if os.environ.get(REUSE_ENV):
        pytest.skip("the reused cluster's processes are not this test's children")
    found: dict[str, list[int]] = {}
    for pid in descendants(os.getpid()):
        line = command_line(pid)
        for role in ("Ingress", "EngineReplica", "MetricsHub", "worker.engine_process"):
            if role in line:
                found.setdefault(role, []).append(pid)
    assert len(found.get("worker.engine_process", ())) == 2, found
    assert found.get("EngineReplica"), f"no engine replica among {found}"
    # Ray starts its workers at one niceness (15 unless RAY_worker_niceness says otherwise):
    # what an engine replica's main thread runs at.
    worker_nice = os.getpriority(os.PRIO_PROCESS, found["EngineReplica"][0])
    engine_nices = set().union(*(nices(pid) for pid in found["worker.engine_process"]))
    assert engine_nices == {worker_nice}, f"an engine thread moved: {engine_nices}"
    for role in ("Ingress", "EngineReplica", "MetricsHub"):
        assert found.get(role), f"no {role} process among {found}"
        # ClusterConfig.support_nice: 10 steps below the workers by default, off the request path
        for pid in found[role]:
            if role == "MetricsHub":
                expected = min(worker_nice + 10, 19)
                assert nices(pid) == {expected}, f"{role} {pid} at {nices(pid)}, not {expected}"
            else:  # (a thread Ray started before it set its worker niceness may be above it)
                assert max(nices(pid)) <= worker_nice, f"{role} {pid} lowered: {nices(pid)}"


def affinities(pid: int) -> set[frozenset[int]]:
    """The CPU sets of the threads of ``pid``."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread ended
            found.add(frozenset(os.sched_getaffinity(int(tid))))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_engines_get_cpus_of_their_own_that_the_request_path_keeps_off(tiny_server):
    # Two one-thread engines, one CPU reserved each: as many as leave one CPU unclaimed get a
    # CPU of their own (one on 2 CPUs); the ingress, relays and hub run on the rest.
    if os.environ.get(REUSE_ENV):
        pytest.skip("the reused cluster's processes are not this test's children")
    cpus = frozenset(os.sched_getaffinity(0))
    roles: dict[str, list[int]] = {}
    for pid in descendants(os.getpid()):
        line = command_line(pid)
        for role in ("Ingress", "EngineReplica", "MetricsHub", "worker.engine_process"):
            if role in line:
                roles.setdefault(role, []).append(pid)
    engines = [affinities(pid) for pid in roles.get("worker.engine_process", ())]
    assert len(engines) == 2, roles
    pinned = [next(iter(a)) for a in engines if a != {cpus}]
    assert len(pinned) == min(2, len(cpus) - 1), engines
    assert all(len(a) == 1 for a in pinned), f"an engine on more than its claim: {pinned}"
    claimed = frozenset().union(*pinned)
    assert len(claimed) == len(pinned), f"two engines on one CPU: {pinned}"
    deadline = time.monotonic() + 3 * cpu_claims.REFRESH_S
    for role in ("Ingress", "EngineReplica", "MetricsHub"):
        for pid in roles[role]:
            while affinities(pid) != {cpus - claimed}:
                assert time.monotonic() < deadline, f"{role} {pid} on {affinities(pid)}"
                time.sleep(0.1)
