"""bench.host_probe: the wall time of a short CPU burst, measured in a child process."""

from __future__ import annotations

import time

from bench.host_probe import HostProbe, burst_wall_ms, summarize


def test_a_burst_takes_at_least_its_cpu_time_in_wall_time():
    assert burst_wall_ms(2.0) >= 2.0


def test_the_summary_counts_the_bursts_above_the_bound():
    summary = summarize([1.0, 1.2, 6.0, 1.1], burst_ms=1.0)
    assert summary["count"] == 4
    assert summary["max_ms"] == 6.0
    assert summary["share_above_5_ms"] == 0.25
    assert summary["p50_ms"] == 1.15
    assert summarize([], 1.0) == {"burst_ms": 1.0, "count": 0}


def test_the_probe_runs_in_a_child_until_stopped():
    probe = HostProbe(burst_ms=0.5, period_ms=5.0).start()
    time.sleep(1.5)  # the child's interpreter starts, then bursts every ~5.5 ms
    summary = probe.stop()
    assert summary["count"] >= 10, summary
    assert summary["p50_ms"] >= 0.5
    assert HostProbe().stop()["error"] == "not started"
