"""bench/scale_failover.py without Ray: what the clients saw around the kill (failures,
texts, streams moved, phases), the report, the flags, and the fault-free text it compares
with (no cluster starts)."""

from __future__ import annotations

import pytest

from bench import scale_failover

KILLED_S = 10.0


def record(index, replica, start_s, end_s, success=True, text="t", ttft_s=0.5):
    return {
        "index": index, "replica": replica, "start_s": start_s, "end_s": end_s,
        "latency_s": end_s - start_s, "success": success, "error": None if success else "boom",
        "text": text, "ttft_s": ttft_s, "prompt_tokens": 100, "cached_tokens": 50,
        "max_gap_s": 3.0 if replica.startswith("b") else 0.2,
    }  # fmt: skip


def test_outcome_counts_the_streams_node_b_held_at_the_kill_and_the_texts_that_differ():
    records = [
        record(0, "b1", 2.0, 30.0),  # in flight on B at the kill: moved
        record(1, "b2", 9.0, 12.0, text="other"),  # in flight on B, its text differs
        record(2, "b1", 1.0, 5.0),  # ended on B before the kill
        record(3, "a1", 5.0, 20.0),  # on A
        record(4, "a1", 15.0, 50.0, success=False),  # after the kill, failed
        record(5, "a2", 45.0, 60.0),  # later phase
    ]
    expected = ["t"] * 6
    out = scale_failover.outcome(records, expected, ["b1", "b2"], KILLED_S)
    assert out["failed"] == 1 and out["errors"] == ["boom"]
    assert out["texts_differing"] == 1 and out["texts_differing_indices"] == [1]
    assert out["in_flight_on_b_at_kill"] == 2 and out["in_flight_on_b_completed"] == 2
    assert out["sent_after_kill_on_b"] == 0
    assert out["failed_over_stall_max_s"] == 3.0 and out["others_stall_p50_s"] == 0.2
    phases = out["phases"]
    assert phases["before_kill"]["num_requests"] == 4
    assert phases["first_30s_after"]["num_requests"] == 1
    assert phases["first_30s_after"]["failed"] == 1
    assert phases["later"]["num_requests"] == 1
    assert phases["all"]["hit_rate"] == 0.5


def test_the_report_names_the_failures_and_every_phase(tmp_path):
    records = [record(0, "b1", 2.0, 30.0), record(1, "a1", 12.0, 40.0)]
    row = {
        "replicas": 2, "replicas_by_node": {"a": ["a1"], "b": ["b1"]}, "num_requests": 2,
        "rate_req_per_s": 1.0, "workload": "w", "time_scale": 10.0, "killed_at_s": KILLED_S,
        "node_b_processes_killed": 9, "failovers_logged": 1, "node_b_declared_dead_after_s": 4.0,
        "liveness_gone_after_s": 9.0, "index_purged_after_s": 9.5, "index_still_holds": {},
        "requests": records,
        **scale_failover.outcome(records, ["t", "t"], ["b1"], KILLED_S),
    }  # fmt: skip
    text = scale_failover.markdown(row)
    assert "failed requests: **0**" in text and "first_30s_after" in text
    assert "declared dead 4.0 s" in text
    scale_failover.plot(row, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("flags", [["--replicas", "3"], ["--kill-at", "1.5"]])
def test_bad_flags_are_usage_errors(flags, monkeypatch):
    monkeypatch.setattr(scale_failover.shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(SystemExit) as exc:
        scale_failover.parse_args(flags)
    assert exc.value.code == 2


def test_the_offline_text_is_the_simulated_engines_whatever_the_batch():
    """The texts every stream is compared with: the same for a prompt alone or in a batch
    (pseudo-tokens are a function of prompt and position)."""
    prompts = [[1000 + i for i in range(40)], [2000 + i for i in range(33)]]
    together = scale_failover.offline_texts(prompts, [12, 7])
    alone = scale_failover.offline_texts(prompts[1:], [7])
    assert together[1] == alone[0] and together[0] and together[0] != together[1]
