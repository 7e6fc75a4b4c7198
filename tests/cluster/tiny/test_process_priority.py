"""The tiny cluster's background runs below its engines, its request path beside them.

The metrics hub lowers itself ``ClusterConfig.support_nice`` steps (10 by default) below the
niceness Ray starts its workers at (``cluster/priority.py``); the engine processes keep it
(``EngineConfig.engine_nice`` is unset by default), and so do the ingress and the engine
replicas' relays, which carry every request and token.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from cluster.priority import descendants
from tests.cluster.conftest import REUSE_ENV


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
