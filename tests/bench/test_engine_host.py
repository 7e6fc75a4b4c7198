"""``bench.engine_host``: host time per decode step, with and without the device wait, in one
row per batch size; the run steps every request in every measured step."""

from __future__ import annotations

import json

import bench.engine_host as engine_host


def test_rows_report_both_ways_and_the_file_is_written(smollm2_path, tmp_path, monkeypatch):
    """``smollm2_path``: the bundled model the benchmark's engine takes its tokenizer from."""
    monkeypatch.setattr(
        engine_host, "result_stem", lambda name, device, tag: tmp_path / f"{name}{tag}"
    )
    assert engine_host.main(["--batch", "4", "--steps", "3", "--repeats", "2"]) == 0
    (row,) = json.loads((tmp_path / "engine_host.json").read_text())["rows"]
    assert row["batch"] == 4 and row["repeats"] == 2
    for key in ("host_cpu_ms_per_step", "no_wait_host_cpu_ms_per_step"):
        low, high = row[f"{key}_p50_range"]
        assert 0 < low <= row[f"{key}_p50"] <= high
    assert row["device_ms_per_step"] > 0
    assert (tmp_path / "engine_host.png").stat().st_size > 0
