"""bench/serve_path.py without Ray: its flags, the CPU kinds, and one ``--quick`` run of the
``offline`` and ``bare`` systems on the simulated engine (the bare server a real subprocess,
streamed to by the load generator's client), its JSON, table and plot."""

from __future__ import annotations

import json

import pytest

from bench import serve_path


def test_flags_and_quick_defaults():
    args = serve_path.parse_args(["--quick"])
    assert (args.concurrency, args.requests_per_concurrency, args.output_tokens) == ([8], 2, 16)
    assert args.engines == ["tiny", "sim"] and args.systems == list(serve_path.DEFAULT_SYSTEMS)
    args = serve_path.parse_args(["--concurrency", "4,32", "--output-tokens", "3"])
    assert (args.concurrency, args.output_tokens, args.prompt_tokens) == ([4, 32], 3, 32)
    assert serve_path.parse_args([]).concurrency == [64, 256, 1024]
    bad_flags = (["--systems", "vllm"], ["--engines", ""], ["--concurrency", "0"])
    for bad in (*bad_flags, ["--stream-interval", "0"]):
        with pytest.raises(SystemExit):
            serve_path.parse_args(bad)


def test_served_command_lines_leave_room_for_the_largest_concurrency():
    args = serve_path.parse_args(["--concurrency", "64,1024"])
    argv = serve_path.server_argv("sim", "served2", "/m", 8000, args)
    flags = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert argv[1:3] == ["-m", "cluster.cli"] and argv[3] == "serve"  # a command line only
    assert flags["--num-replicas"] == flags["--num-ingress-replicas"] == "2"
    assert flags["--max-num-seqs"] == "256" and flags["--engine"] == "sim"
    assert int(flags["--max-ongoing-requests"]) >= 1024
    assert int(flags["--max-queued-requests"]) >= 1024
    assert int(flags["--num-kv-blocks"]) >= 256 * (32 + 128) // 16
    assert "--direct-ingress" not in argv
    assert flags["--stream-interval"] == "1"  # a message per token unless asked
    every_4 = serve_path.parse_args(["--stream-interval", "4"])
    assert "--stream-interval 4" in " ".join(
        serve_path.server_argv("sim", "direct1", "/m", 1, every_4)
    )
    direct = serve_path.server_argv("sim", "direct2", "/m", 8000, args)
    assert "--direct-ingress" in direct and direct[direct.index("--num-replicas") + 1] == "2"
    assert "--handle-transport" not in direct
    on_ray = serve_path.server_argv("sim", "direct1-ray", "/m", 8000, args)
    assert on_ray[on_ray.index("--handle-transport") + 1] == "ray" and "--direct-ingress" in on_ray
    assert serve_path.num_replicas("direct1-ray") == 1
    bare = serve_path.server_argv("tiny", "bare", "/m", 8000, args)
    assert bare[1:3] == ["-m", "bench.bare_server"] and "--engine" not in bare
    assert "--stream-interval" not in bare  # it streams every token
    assert "--engine-cpu-affinity" not in direct  # unpinned unless asked
    pinned = serve_path.parse_args(["--engine-cpu-affinity"])
    assert "--engine-cpu-affinity" in serve_path.server_argv("tiny", "direct1", "/m", 1, pinned)
    assert "--engine-cpu-affinity" not in serve_path.server_argv("tiny", "bare", "/m", 1, pinned)


def test_cpu_kinds_name_every_served_process():
    kinds = {
        "ray::ProxyActor": "proxy",
        "ray::ServeReplica:prefixserve:Ingress": "ingress",
        "ray::ServeReplica:prefixserve:EngineReplica": "replica",
        "ray::ServeReplica:prefixserve:MetricsHub": "ray",
        "ray::ServeController": "ray",
        "python -m worker.engine_process": "engine",
        "python -m bench.bare_server": "server",
        "python -m cluster.cli": "ray",
        "gcs_server": "ray",
    }
    assert {label: serve_path.cpu_kind(label) for label in kinds} == kinds
    fields = serve_path.cpu_fields({"engine": 2.0, "server": 0.5, "client": 1.0}, 1000)
    assert fields["cpu_s_per_1k_tokens"] == {"engine": 2.0, "server": 0.5, "client": 1.0}
    assert fields["outside_engine_ms_per_token"] == 0.5  # the client is not the server


def test_quick_offline_and_bare_on_the_simulated_engine(tmp_path):
    out = tmp_path / "out"
    argv = ["--quick", "--engines", "sim", "--systems", "offline,bare", "--out-dir", str(out)]
    assert serve_path.main([*argv, "--log-dir", str(tmp_path / "logs")]) == 0
    (json_path,) = out.glob("serve_path_*_quick.json")
    data = json.loads(json_path.read_text())
    header = data["header"]
    assert header["command"].startswith("python -m bench.serve_path --quick")
    assert header["cpu"] and header["git_commit"] and header["date"]
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == {"offline", "bare"}
    for row in rows.values():
        assert "error" not in row and row["concurrency"] == 8 and row["failed"] == 0
        assert row["output_tokens"] == 16 * 16 and row["output_tok_per_s"] > 0
        assert "engine" in row["cpu_s_by_kind"] and "engine" in row["cpu_s_per_1k_tokens"]
    bare = rows["bare"]
    assert 0 < bare["ttft_p50_ms"] <= bare["ttft_p99_ms"]
    assert 0 < bare["itl_p50_ms"] <= bare["itl_p99_ms"]
    assert {"engine", "server", "client"} <= set(bare["cpu_s_by_kind"])
    assert bare["outside_engine_ms_per_token"] is not None
    assert rows["offline"]["outside_engine_ms_per_token"] is None
    png = json_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| sim | bare | 8 | 16/0 |" in json_path.with_suffix(".md").read_text()
