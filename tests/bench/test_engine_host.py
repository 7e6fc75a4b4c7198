"""``bench.engine_host``: host time per decode step, with and without the device wait, and the
engine process's loop step and step message, in one row per batch size; the run steps every
request in every measured step."""

from __future__ import annotations

import json

import pytest

import bench.engine_host as engine_host


def test_rows_report_both_ways_and_the_file_is_written(smollm2_path, tmp_path, monkeypatch):
    """``smollm2_path``: the bundled model the benchmark's engine takes its tokenizer from."""
    monkeypatch.setattr(
        engine_host, "result_stem", lambda name, device, tag: tmp_path / f"{name}{tag}"
    )
    assert engine_host.main(["--batch", "4", "--steps", "3", "--repeats", "2"]) == 0
    (row,) = json.loads((tmp_path / "engine_host.json").read_text())["rows"]
    assert row["batch"] == 4 and row["repeats"] == 2
    for key in (
        "host_cpu_ms_per_step",
        "no_wait_host_cpu_ms_per_step",
        "loop_cpu_ms_per_step",
        "message_cpu_ms_per_step",
        "loop_wall_ms_per_step",
        "overlapped_loop_wall_ms_per_step",
    ):
        low, high = row[f"{key}_p50_range"]
        assert 0 <= low <= row[f"{key}_p50"] <= high
    assert row["host_cpu_ms_per_step_p50"] > 0 and row["loop_cpu_ms_per_step_p50"] > 0
    assert row["message_bytes"] > 4 * 40  # four requests' deltas, each with its id and token
    assert row["device_ms_per_step"] > 0
    # Sequential, a step's wall time holds the slept device time and the host's work after it.
    assert row["loop_wall_ms_per_step_p50"] >= row["device_ms_per_step"]
    assert (tmp_path / "engine_host.png").stat().st_size > 0


def test_device_steps_split_each_step_and_profile(tiny_models, tmp_path):
    """The real engine's split on the CPU: no device to wait for, so the host's share is the
    whole step; every measured step decodes every request; the profile is written."""
    profile = tmp_path / "steps.txt"
    row = engine_host.device_steps(tiny_models["llama"], 4, 5, "cpu", True, profile)
    assert row["batch"] == 4 and row["steps"] == 5 and not row["graphs"]
    assert row["device_wait_ms_p50"] == 0 and row["host_ms_p50"] == row["step_ms_p50"] > 0
    assert row["host_share_of_step"] == 1.0
    assert "step_deltas" in profile.read_text() or "_advance" in profile.read_text()


def test_device_steps_through_the_engine_loop_overlapped_or_not(tiny_models):
    """Through the engine loop the row adds the step message; overlapped, the device is not
    waited for on its own, so the row has no host/device split."""
    sequential = engine_host.device_steps(tiny_models["llama"], 4, 5, "cpu", through_loop=True)
    assert sequential["message_bytes"] > 4 * 20 and sequential["host_ms_p50"] > 0
    overlapped = engine_host.device_steps(
        tiny_models["llama"], 4, 5, "cpu", through_loop=True, overlap=True
    )
    assert overlapped["overlap"] and overlapped["host_ms_p50"] is None
    assert overlapped["steps"] == 5 and overlapped["tokens_per_s"] > 0


def test_a_lone_request_is_timed_overlapped_and_not(smollm2_path):
    for overlap in (False, True):
        first_ms, total_ms = engine_host.one_request_ms(overlap, 2, "gpu", "smollm2")
        assert 0 < first_ms < total_ms


def test_graph_inputs_are_timed_per_step():
    """The graph-input timing runs the padded buffers eagerly on the CPU and gives a time."""
    assert engine_host.graph_inputs_ms(4, 40, steps=20) > 0


def test_detokenize_cost_is_reported_by_stretch_of_the_output(smollm2_path):
    rows = engine_host.detokenize_us_per_token("smollm2", 2000, ["\n\nUser:"])
    assert [r["tokens"] for r in rows] == ["0-500", "500-1000", "1000-2000"]
    assert all(r["us_per_token"] > 0 for r in rows)


def test_device_steps_keep_every_request_running_through_a_long_admission(tiny_models):
    """Prompts that take several steps to admit (the first ones decode meanwhile) still leave
    every request running through every measured step."""
    row = engine_host.device_steps(tiny_models["llama"], 40, 126, "cpu", False, prompt_tokens=600)
    assert row["steps"] == 126 and row["batch"] == 40


def test_host_ab_steps_two_trees_in_turns_and_writes_the_ratio(tmp_path, monkeypatch):
    """``bench.host_ab`` against this same tree: both sides step, each round gives a ratio."""
    import bench.host_ab as host_ab
    from bench.result_files import REPO

    monkeypatch.setattr(host_ab, "result_stem", lambda name, device, tag: tmp_path / name)
    assert host_ab.main([str(REPO), "--batch", "4", "--rounds", "4", "--steps-per-turn", "3"]) == 0
    (row,) = json.loads((tmp_path / "host_ab.json").read_text())["rows"]
    assert row["batch"] == 4 and row["rounds"] == 4
    assert row["this_step_ms_p50"] > 0 and row["other_step_ms_p50"] > 0
    assert 0.2 < row["ratio_median"] < 5
    with pytest.raises(SystemExit):
        host_ab.main([str(tmp_path)])  # not a tree of this repository
