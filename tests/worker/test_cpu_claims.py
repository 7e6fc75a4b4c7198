"""CPU claims (``worker/cpu_claims.py``): an engine process claims CPUs node-wide while one stays
unclaimed, a dead claimer's CPUs come back, and a serving process keeps its threads off what is
claimed. Claims pin the process that makes them, so every claim here is made in a child
process, never in the test's own, against a claims folder of the test's own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cluster.config import ClusterConfig
from worker import cpu_claims
from worker.config import EngineConfig
from worker.engine_process import cpus_to_claim

CPUS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="claims leave one CPU unclaimed")


@pytest.fixture(autouse=True)
def claims_dir(tmp_path, monkeypatch):
    """The test's own claims folder, for this process's reads as for its children."""
    monkeypatch.setattr(cpu_claims, "CLAIMS_DIR", tmp_path)
    return tmp_path


def child(claims_dir, code: str) -> subprocess.Popen:
    """A Python child with ``cpu_claims`` pointed at ``claims_dir``; prints what ``code`` prints,
    then waits for a line on stdin before it exits (so its claims stay held until then)."""
    script = (
        "import os, sys, threading, time, pathlib\n"
        "from worker import cpu_claims\n"
        f"cpu_claims.CLAIMS_DIR = pathlib.Path({str(claims_dir)!r})\n"
        + textwrap.dedent(code)
        + "\nprint('done', flush=True)\nsys.stdin.readline()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != cpu_claims.NODE_CPUS_ENV},
    )


def lines_until_done(proc: subprocess.Popen) -> list[str]:
    lines = []
    for line in proc.stdout:
        if line.strip() == "done":
            return lines
        lines.append(line.strip())
    raise AssertionError(f"child exited early ({proc.wait()}): {lines}")


def finish(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


CLAIM_ONE = """
claim = cpu_claims.claim_cpus(1)
print(sorted(claim.cpus) if claim else None)
print(sorted(os.sched_getaffinity(0)))
"""


@needs_two_cpus
def test_a_claim_pins_the_highest_cpu_and_leaves_one_for_the_request_path(tmp_path):
    # 1 CPU per claim: with N CPUs, N-1 engines get one each, the Nth is refused.
    holders = []
    try:
        for expected in sorted(CPUS, reverse=True)[: len(CPUS) - 1]:
            holders.append(child(tmp_path, CLAIM_ONE))
            claimed, affinity = lines_until_done(holders[-1])
            assert claimed == affinity == f"[{expected}]"
        assert cpu_claims.claimed_cpus(CPUS) == CPUS - {min(CPUS)}
        refused = child(tmp_path, CLAIM_ONE)
        claimed, affinity = lines_until_done(refused)
        assert claimed == "None"
        assert affinity == str(sorted(CPUS))  # unpinned
        finish(refused)
    finally:
        for holder in holders:
            finish(holder)
    # The kernel released the holders' locks with their processes.
    assert cpu_claims.claimed_cpus(CPUS) == frozenset()
    again = child(tmp_path, CLAIM_ONE)
    assert lines_until_done(again)[0] == f"[{max(CPUS)}]"
    finish(again)


@needs_two_cpus
def test_engines_starting_at_once_never_claim_the_last_cpu(tmp_path):
    racers = [child(tmp_path, CLAIM_ONE) for _ in range(len(CPUS) + 2)]
    try:
        granted = [lines_until_done(racer)[0] for racer in racers]
        claimed = [g for g in granted if g != "None"]
        assert len(claimed) == len(CPUS) - 1
        assert len(set(claimed)) == len(claimed)  # no CPU twice
    finally:
        for racer in racers:
            finish(racer)


@needs_two_cpus
def test_a_serving_process_keeps_off_claimed_cpus_and_comes_back_when_they_are_free(tmp_path):
    holder = child(tmp_path, CLAIM_ONE)
    claimed = lines_until_done(holder)[0]
    keeper = child(
        tmp_path,
        """
        cpu_claims.REFRESH_S = 0.05
        cpu_claims.keep_off_claims("test")
        print(sorted(os.sched_getaffinity(0)))
        seen = []
        worker = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
        worker.start(); worker.join()
        print(seen[0])
        sys.stdin.readline()  # the holder exits meanwhile
        deadline = time.monotonic() + 10
        while os.sched_getaffinity(0) != set(cpu_claims.node_cpus()):
            assert time.monotonic() < deadline, os.sched_getaffinity(0)
            time.sleep(0.05)
        print(sorted(os.sched_getaffinity(0)))
        """,
    )
    shared = str(sorted(CPUS - {int(claimed.strip("[]"))}))
    assert keeper.stdout.readline().strip() == shared  # the main thread
    assert keeper.stdout.readline().strip() == shared  # a thread started later
    finish(holder)
    keeper.stdin.write("\n")
    keeper.stdin.flush()
    assert keeper.stdout.readline().strip() == str(sorted(CPUS))
    assert lines_until_done(keeper) == []
    finish(keeper)


@needs_two_cpus
def test_a_serving_process_watches_the_claims_folder_it_started_with(tmp_path):
    """A process whose ``CLAIMS_DIR`` moves later (this module's tests point it at their own
    folders) keeps watching the folder its keeper started with: claims elsewhere must not
    narrow its CPUs, nor those of the children it starts."""
    elsewhere = tmp_path / "elsewhere"
    keeper = child(
        tmp_path / "started",
        f"""
        cpu_claims.REFRESH_S = 0.05
        cpu_claims.keep_off_claims("test")
        cpu_claims.CLAIMS_DIR = pathlib.Path({str(elsewhere)!r})
        print("ready", flush=True)
        sys.stdin.readline()  # a claim is held in the other folder meanwhile
        time.sleep(0.5)  # ten refreshes
        print(sorted(os.sched_getaffinity(0)))
        """,
    )
    assert keeper.stdout.readline().strip() == "ready"
    holder = child(elsewhere, CLAIM_ONE)
    try:
        assert lines_until_done(holder)[0] == f"[{max(CPUS)}]"
        keeper.stdin.write("\n")
        keeper.stdin.flush()
        assert lines_until_done(keeper) == [str(sorted(CPUS))]
    finally:
        finish(holder)
    finish(keeper)


def test_an_engine_claims_what_its_loop_uses_within_its_allowance():
    cpu = {"device": "cpu", "claim_cpus": 1}
    assert cpus_to_claim(EngineConfig(model="m", engine="sim", claim_cpus=1)) == 1
    assert cpus_to_claim(EngineConfig(model="m", num_threads=1, **cpu)) == 1
    assert cpus_to_claim(EngineConfig(model="m", num_threads=2, **cpu)) == 0  # more than allowed
    assert cpus_to_claim(EngineConfig(model="m", **cpu)) == 0  # torch's threads span every core
    assert cpus_to_claim(EngineConfig(model="m", num_threads=1, device="cpu")) == 0  # not allowed
    assert cpus_to_claim(EngineConfig(model="m", device="cuda", num_threads=1, claim_cpus=1)) == 0


def test_the_cluster_allows_the_whole_cpus_a_replica_reserves():
    assert ClusterConfig().engine_cpus_to_claim == 0  # off by default
    on = {"engine_cpu_affinity": True}
    assert ClusterConfig(**on).engine_cpus_to_claim == 1
    assert ClusterConfig(num_cpus_per_replica=2.5, **on).engine_cpus_to_claim == 2
    assert ClusterConfig(num_cpus_per_replica=0.05, **on).engine_cpus_to_claim == 0
    with pytest.raises(ValueError, match="engine_cpu_affinity"):
        ClusterConfig(engine_cpu_affinity="yes")
    with pytest.raises(ValueError, match="claim_cpus"):
        EngineConfig(model="m", claim_cpus=-1)


def test_a_claims_folder_that_cannot_be_made_pins_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = child(blocker / "claims", CLAIM_ONE)  # a folder under a file: mkdir fails
    claimed, affinity = lines_until_done(proc)
    assert claimed == "None" and affinity == str(sorted(CPUS))
    finish(proc)


@needs_two_cpus
def test_an_engine_process_claims_its_cpu_before_its_threads_start(
    tiny_models, claims_dir, monkeypatch
):
    import asyncio

    from worker import AsyncEngine

    monkeypatch.setenv("PREFIXSERVE_CPU_CLAIMS_DIR", str(claims_dir))  # read by the child
    config = EngineConfig(model=tiny_models["llama"], engine="sim", claim_cpus=1)
    engine = AsyncEngine(config)
    try:
        pid = engine._core._proc.pid
        threads = os.listdir(f"/proc/{pid}/task")
        assert len(threads) > 1  # the engine's own threads, started after the claim
        pinned = {frozenset(os.sched_getaffinity(int(t))) for t in threads}
        assert pinned == {frozenset({max(CPUS)})}
        assert cpu_claims.claimed_cpus(CPUS) == {max(CPUS)}
    finally:
        asyncio.run(engine.shutdown(1.0))
    assert cpu_claims.claimed_cpus(CPUS) == frozenset()
