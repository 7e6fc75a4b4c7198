"""Faults under load on one tiny-model cluster: no request lost, none errored, no answer
changed, no KV block leaked.

One module-scoped cluster (``tests.cluster.conftest.start_tiny_cluster``: 2 engine replicas,
2 ingress replicas) serves a closed loop of a few streaming greedy chat requests, the load
``bench/chaos/`` runs, sized for CI. A fault-free run records each prompt's text; then,
one after another under the same load: a client disconnect storm, slow readers that stop
draining their streams, the embedded index actor SIGKILLed, an engine replica SIGKILLed.
For each fault every request of the load must end normally (the ingress fails a cut
stream over to the other replica, and a dead index only costs routing), with exactly the
fault-free text, and once the load is over every replica must hold 0 KV blocks (read from
``kv_cache_usage_perc`` at ``/metrics``: blocks of dropped or cut streams freed). A kill
fault must also have cut streams in flight, so a pass is never a load that missed the
fault, and the cluster must serve again (the killed process back) before the next fault.
"""

from __future__ import annotations

import os

import pytest

from bench.chaos.faults import KILL_TITLES
from bench.chaos.load import Load, Target
from bench.chaos.run import run_baseline, run_fault

pytestmark = pytest.mark.slow

# ``start_tiny_cluster``'s KV blocks per replica (a larger figure would still count any held
# block: usage is rounded up).
TINY_NUM_KV_BLOCKS = 512
# Short prompts, each its own text: greedy tokens of a random tiny model, checked per prompt.
PROMPTS = [[{"role": "user", "content": f"chaos {i}: {'abcdefgh'[i]} " * 3}] for i in range(6)]
LOAD = Load(
    concurrency=4,
    duration_s=6.0,
    max_tokens=48,
    storm_streams=12,
    storm_max_tokens=200,
    slow_streams=4,
    slow_read_s=0.5,
)
FAULT_AT_S = 2.0
PROBE = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(target, fault-free texts by prompt) on a fresh tiny cluster started by this process."""
    from tests.cluster.conftest import start_tiny_cluster

    server, teardown = start_tiny_cluster(tmp_path_factory.mktemp("chaos-tiny") / "llama")
    try:
        target = Target(server.url, os.getpid(), server.headers, TINY_NUM_KV_BLOCKS)
        row, baseline = run_baseline(target, PROMPTS, LOAD)
        assert (row.lost, row.errored, row.leaked_blocks) == (0, 0, 0), row
        assert sorted(baseline) == list(range(len(PROMPTS))), "a prompt never finished"
        assert all(baseline.values()), baseline
        yield target, baseline
    finally:
        teardown()


@pytest.mark.parametrize(
    "fault", ["disconnect_storm", "slow_readers", "index_kill", "replica_kill"]
)
def test_fault_under_load_loses_nothing_and_leaks_nothing(cluster, fault):
    target, baseline = cluster
    res = run_fault(fault, target, PROMPTS, LOAD, baseline, PROBE, fault_at_s=FAULT_AT_S)
    print(res)
    assert not res.note.startswith("skipped"), res.note
    assert res.requests >= LOAD.concurrency, res
    assert res.lost == 0, res
    assert res.errored == 0, res.errors
    assert res.mismatched == 0, res
    assert res.recovery_s is not None, "the cluster did not serve again with the process back"
    assert res.leaked_blocks == 0, res
    if fault in KILL_TITLES:
        assert res.in_flight_at_fault >= 2, f"too few streams cut by the kill: {res}"
