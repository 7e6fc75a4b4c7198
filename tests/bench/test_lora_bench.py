"""bench/lora.py's ``--quick`` run end to end (tiny model, tiny adapters): its flags, the
cells it runs, and the JSON, table and plot it writes. No timed assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import lora


def test_flags():
    args = lora.parse_args([])
    assert (args.ranks, args.adapters, args.batch, args.rounds) == ([8, 16], [0, 1, 4, 16], 32, 3)
    assert args.modes == ["deterministic", "fast"]
    assert lora.parse_args(["--adapters", "4,16"]).adapters == [0, 4, 16]  # base always runs
    for bad in (["--modes", "slow"], ["--adapters", "32"], ["--adapters", "8", "--batch", "4"]):
        with pytest.raises(SystemExit):
            lora.parse_args(bad)


def test_verdict_names_the_target_cell():
    rows = [
        {"mode": "deterministic", "rank": None, "adapters": 0, "share_of_base": 1.0},
        {"mode": "deterministic", "rank": 16, "adapters": 16, "share_of_base": 0.69},
        {"mode": "fast", "rank": 16, "adapters": 16, "share_of_base": 0.9},
    ]
    assert lora.verdict(rows)["verdict"] == "FAIL"
    rows[1]["share_of_base"] = 0.7
    assert lora.verdict(rows)["verdict"] == "PASS"
    assert lora.verdict(rows[:1])["verdict"] == "NOT RUN"


def test_quick_run_writes_json_table_and_plot(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_CACHE", str(tmp_path / "cache"))
    assert lora.main(["--quick", "--out-dir", str(tmp_path), "--tag", "t"]) == 0
    (js,) = tmp_path.glob("lora_cpu_*_t.json")
    stem = str(js)[: -len(".json")]
    result = json.loads(js.read_text())
    for key in ("benchmark", "date", "command", "machine", "git_commit", "cpu_description"):
        assert result[key]
    assert result["benchmark"] == "lora" and result["workload"]["batch"] == 8
    cells = {(r["mode"], r["rank"], r["adapters"]) for r in result["rows"]}
    assert cells == {("deterministic", None, 0)} | {
        ("deterministic", rank, n) for rank in (4, 8) for n in (1, 4)
    }
    for row in result["rows"]:
        assert row["tok_s"] > 0 and row["output_tokens"] == 8 * 8
        assert row["share_of_base"] > 0 and len(row["rounds"]) == 1
    assert result["verdict"]["verdict"] == "NOT RUN"  # rank 16 is not in --quick
    table = Path(f"{stem}.md").read_text()
    assert "| rank | 1 adapter | 4 adapters |" in table and "| 8 |" in table
    assert Path(f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
