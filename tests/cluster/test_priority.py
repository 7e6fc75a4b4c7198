"""``cluster/priority.py``: serving processes lower themselves below the engines, never raise.

Real child processes (no Ray): every thread of a process is lowered, a process already lower
stays where it is, a local Ray's system processes are found by their command lines (not the
raylet, whose arguments name the agents), and ``ClusterConfig`` checks the value.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.priority import (
    descendants,
    lower_priority,
    lower_ray_system_priority,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A child with a second thread, and an argument a marker matches (or not).
CHILD = (
    "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "time.sleep(60)\n"
)


def spawn(*words: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *words])
    deadline = time.monotonic() + 10
    while len(os.listdir(f"/proc/{proc.pid}/task")) < 2:  # wait for the second thread
        assert time.monotonic() < deadline, "child never started its thread"
        time.sleep(0.02)
    return proc


def thread_nices(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_every_thread_is_lowered_and_a_lower_one_is_never_raised(children):
    child = spawn()
    children.append(child)
    assert thread_nices(child.pid) == {os.getpriority(os.PRIO_PROCESS, 0)}
    assert lower_priority(child.pid, 7) == 2
    assert thread_nices(child.pid) == {7}
    assert lower_priority(child.pid, 3) == 0  # only ever lowered
    assert thread_nices(child.pid) == {7}
    assert lower_priority(child.pid, 0) == 0
    assert lower_priority(child.pid, 40) == 2  # capped at 19
    assert thread_nices(child.pid) == {19}


def test_a_gone_process_changes_nothing_and_raises_nothing(children):
    child = spawn()
    child.kill()
    child.wait()
    assert lower_priority(child.pid, 10) == 0


def test_own_priority_is_lowered_in_a_child_only():
    code = (
        "import os, threading, time; from cluster.priority import lower_own_priority\n"
        "threading.Thread(target=time.sleep, args=(1,)).start()\n"
        "lower_own_priority(5, 'test')\n"
        "print(sorted({os.getpriority(os.PRIO_PROCESS, int(t))"
        " for t in os.listdir('/proc/self/task')}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str([min(os.getpriority(os.PRIO_PROCESS, 0) + 5, 19)])


def spawn_named(*argv: str) -> subprocess.Popen:
    """A shell whose command line starts with ``argv[0]`` (as a Ray worker's proctitle does),
    then ``-c`` and its script, then ``argv[1:]``."""
    words = " ".join(f"'{w}'" for w in argv[1:])
    script = f"exec -a '{argv[0]}' bash -c 'sleep 60; true' {words}"
    proc = subprocess.Popen(["bash", "-c", script])
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{proc.pid}/cmdline").read_text().startswith(argv[0]):
        assert time.monotonic() < deadline, "child never took its name"
        time.sleep(0.02)
    return proc


def test_ray_system_processes_are_found_by_command_line_not_the_raylet(children):
    marked = spawn_named("ray::ServeController")
    gcs = spawn_named("/x/ray/core/src/ray/gcs/gcs_server")
    raylet = spawn_named("/x/ray/core/src/ray/raylet/raylet", "--agent=ray::DashboardAgent")
    replica = spawn_named("ray::ServeReplica:app:EngineReplica")
    late = spawn_named("python", "ray::ServeController")  # past the first 3 words
    proxy = spawn_named("ray::ProxyActor")  # the request path keeps its priority
    children += [marked, gcs, raylet, replica, late, proxy]
    assert {p.pid for p in children} <= set(descendants(os.getpid()))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert sorted(lower_ray_system_priority(6)) == sorted([marked.pid, gcs.pid])
    assert thread_nices(marked.pid) == thread_nices(gcs.pid) == {min(base + 6, 19)}
    assert lower_ray_system_priority(6) == []  # steps count from this process, not again
    for other in (raylet, replica, late, proxy):
        assert thread_nices(other.pid) == {base}


@pytest.mark.parametrize("bad", [-1, 20, 2.5, "10"])
def test_config_refuses_a_nice_value_out_of_range(bad):
    with pytest.raises(ValueError, match="support_nice"):
        ClusterConfig(support_nice=bad)
    assert ClusterConfig().support_nice == 10
