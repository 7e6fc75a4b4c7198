"""Router metrics: counters by policy and reason, matched-block ratio, latency buckets."""

from __future__ import annotations

import json

import pytest

from router.metrics import RouterMetrics
from router.policy import RoutingReason


def test_snapshot_counts_decisions_ratio_and_latency_buckets():
    metrics = RouterMetrics()
    assert metrics.matched_block_ratio is None
    metrics.record_decision("prefix", "prefix", num_prompt_blocks=10, num_matched_blocks=8)
    metrics.record_decision("prefix", "fallback", num_prompt_blocks=10, num_matched_blocks=0)
    metrics.record_decision("prefix", "prefix", num_prompt_blocks=20, num_matched_blocks=12)
    for latency_ms in (0.03, 0.3, 0.3, 0.7, 500.0):
        metrics.record_lookup(latency_ms)
    metrics.record_index_error()
    snapshot = json.loads(json.dumps(metrics.snapshot()))
    assert snapshot["decisions"] == [
        {"policy": "prefix", "reason": "fallback", "count": 1},
        {"policy": "prefix", "reason": "prefix", "count": 2},
    ]
    assert snapshot["matched_block_ratio"] == 0.5
    assert snapshot["num_fallback_decisions"] == 1
    assert snapshot["num_index_errors"] == 1
    latency = snapshot["lookup_latency_ms"]
    assert latency["count"] == 5 and sum(latency["counts"]) == 5
    assert latency["counts"][-1] == 1  # 500 ms lies above every bucket
    assert metrics.lookup_latency_ms.quantile(0.5) == 0.5
    assert metrics.lookup_latency_ms.quantile(1.0) is None


def test_decisions_take_routing_reasons_and_reject_unknown_ones():
    metrics = RouterMetrics()
    metrics.record_decision(
        "pow2", RoutingReason.BASELINE, num_prompt_blocks=1, num_matched_blocks=0
    )
    metrics.record_decision(
        "prefix", RoutingReason.FALLBACK, num_prompt_blocks=1, num_matched_blocks=0
    )
    with pytest.raises(ValueError):
        metrics.record_decision("prefix", "cache_hit", num_prompt_blocks=1, num_matched_blocks=0)
    with pytest.raises(ValueError):
        metrics.record_decision("prefix", "load", num_prompt_blocks=1, num_matched_blocks=0)
    rows = metrics.snapshot()["decisions"]
    assert [(r["policy"], r["reason"]) for r in rows] == [
        ("pow2", "baseline"),
        ("prefix", "fallback"),
    ]
    assert all(type(r["reason"]) is str for r in rows)  # plain label strings, not enum members
    assert metrics.snapshot()["num_fallback_decisions"] == 1


def test_routing_reasons_are_their_label_strings():
    assert RoutingReason("load_bound") is RoutingReason.LOAD_BOUND
    assert (
        str(RoutingReason.SHORTEST_QUEUE) == f"{RoutingReason.SHORTEST_QUEUE}" == "shortest_queue"
    )
    assert RoutingReason.PREFIX == "prefix"
    assert len({r.value for r in RoutingReason}) == len(RoutingReason)


def test_decision_latency_is_its_own_histogram_and_snapshots_merge_with_it():
    from router.metrics import merge_snapshots

    first, second = RouterMetrics(), RouterMetrics()
    first.record_decision_latency(0.7)
    second.record_decision_latency(3.0)
    second.record_decision_latency(40.0)
    merged = merge_snapshots(first.snapshot(), second.snapshot())
    decision = merged["decision_latency_ms"]
    assert decision["count"] == 3 and decision["sum"] == pytest.approx(43.7)
    assert decision["counts"][decision["bounds"].index(1.0)] == 1  # 0.7 ms: in the 1 ms bucket
    assert decision["counts"][decision["bounds"].index(50.0)] == 1  # 40 ms: in the 50 ms one
    assert merged["lookup_latency_ms"]["count"] == 0  # the other histogram stays apart
    older = {k: v for k, v in second.snapshot().items() if k != "decision_latency_ms"}
    assert merge_snapshots(first.snapshot(), older)["decision_latency_ms"]["count"] == 1
    assert merge_snapshots(None, older) == older


def test_a_decisions_cpu_time_is_kept_beside_its_latency_and_merges():
    from router.metrics import merge_snapshots

    first, second = RouterMetrics(), RouterMetrics()
    first.record_decision_latency(12.0, 0.8)  # waited 11 ms for the GIL or a core
    second.record_decision_latency(3.0, 2.5)
    merged = merge_snapshots(first.snapshot(), second.snapshot())
    cpu, wall = merged["decision_cpu_ms"], merged["decision_latency_ms"]
    assert cpu["count"] == wall["count"] == 2
    assert cpu["sum"] == pytest.approx(3.3) and wall["sum"] == pytest.approx(15.0)
    assert cpu["counts"][cpu["bounds"].index(1.0)] == 1
    assert cpu["counts"][cpu["bounds"].index(5.0)] == 1
    assert wall["counts"][wall["bounds"].index(25.0)] == 1
