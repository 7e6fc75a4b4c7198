"""bench.load_tracker: the tracker driven as a router under load drives it, small."""

from __future__ import annotations

import json

from bench.load_tracker import main, measure


def test_a_round_times_decisions_and_snapshots():
    figures = measure(num_replicas=4, in_flight=20, decisions=60, seed=0)
    assert figures["decision_cpu_ms"] > 0 and figures["snapshot_cpu_ms"] > 0


def test_the_command_writes_its_result_file(tmp_path):
    out = tmp_path / "load_tracker.json"
    args = ["--replicas", "4", "--in-flight", "5,20", "--decisions", "40", "--repeats", "1"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["in_flight"] for row in result["rows"]] == [5, 20]
    assert result["command"] == "python -m bench.load_tracker " + " ".join(
        args + ["--out", str(out)]
    )
    assert out.with_suffix(".png").exists()
