"""``bench.step_anatomy``: an engine-loop decode step part by part. The parts are each their
own time (a timed call inside another counts once), so with ``other`` they add up to the step;
a step scheduled ahead waits for its ids where the sampler would have; the run writes its
file and plot."""

from __future__ import annotations

import json

import pytest

import bench.step_anatomy as step_anatomy
from bench.engine_host import _sim_engine, decode_engine


def _check_parts_add_up(row: dict) -> None:
    ms = row["ms_p50"]
    assert set(ms) == {*step_anatomy.PARTS, "other", "step"}
    assert all(value >= 0 for key, value in ms.items() if key != "other")
    assert ms["step"] > 0 and row["tokens_per_s"] > 0
    assert row["critical_ms_p50"] == pytest.approx(
        sum(ms[p] for p in step_anatomy.CRITICAL), abs=0.01
    )


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_the_simulated_engine_step_is_split_into_its_parts(smollm2_path, ahead):
    engine = _sim_engine(4, "gpu", "smollm2", wait=True, async_scheduling=ahead)
    row = step_anatomy.anatomy(engine, 6, True, "cpu")
    _check_parts_add_up(row)
    assert row["batch"] == 4 and row["steps"] == 6
    assert row["scheduled_ahead"] is (ahead == "on")
    ms = row["ms_p50"]
    # The slept forward pass is the step's largest part; the host parts run beside it.
    assert ms["device_wait"] > max(ms["append"], ms["schedule"], ms["deltas"])
    assert ms["execute"] > 0 and ms["schedule"] > 0 and ms["append"] > 0


def test_a_real_engine_step_on_the_cpu_has_no_wait_and_no_graphs(tiny_models):
    engine, _ = decode_engine(tiny_models["llama"], 4, 5, "cpu")
    row = step_anatomy.anatomy(engine, 5, False, "cpu")
    _check_parts_add_up(row)
    assert row["ms_p50"]["fill"] == 0 and not row["scheduled_ahead"]
    assert row["ms_p50"]["execute"] > row["ms_p50"]["device_wait"]  # the pass runs in it


def test_the_run_writes_rows_and_a_plot(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setattr(
        step_anatomy, "result_stem", lambda name, device, tag: tmp_path / f"{name}{tag}"
    )
    args = ["--batch", "4", "--steps", "4", "--overlap", "off", "on", "--async", "off", "on"]
    assert step_anatomy.main(args) == 0
    rows = json.loads((tmp_path / "step_anatomy.json").read_text())["rows"]
    assert [(r["overlap"], r["scheduled_ahead"]) for r in rows] == [
        (False, False),
        (True, False),
        (True, True),
    ]
    assert (tmp_path / "step_anatomy.png").stat().st_size > 0
