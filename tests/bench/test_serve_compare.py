"""bench/serve_compare.py without a cluster: the oracle's cached tokens, the report (verdict,
medians over runs, tables, plot: bench/serve_compare_report.py) and the arguments."""

from __future__ import annotations

import pytest

from bench import cache_accounting as ca
from bench import serve_compare as sc
from bench import serve_compare_report as report

B = 4  # block size of these tests


def test_oracle_counts_each_distinct_prefix_block_once():
    a = list(range(10))  # 2 full blocks + 2 tokens
    b = list(range(8)) + [99, 98, 97, 96, 95]  # shares a's 2 blocks, then its own
    c = [7] * 9  # nothing shared
    assert ca.oracle_cached_tokens([a, b, c], B) == [0, 8, 0]
    # The third copy of a prompt hits as much as the second: the prefix is prefilled once.
    assert ca.oracle_cached_tokens([a, a, a], B) == [0, 8, 8]


def test_oracle_is_prefix_chained_and_capped_like_the_engine():
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [0, 0, 0, 0, 5, 6, 7, 8]  # same second block, different first: no hit
    assert ca.oracle_cached_tokens([a, b], B) == [0, 0]
    # A whole-prompt repeat: the last token is always computed, so 1 block, not 2.
    assert ca.oracle_cached_tokens([a, a], B) == [0, 4]
    assert ca.oracle_cached_tokens([a + [9], a + [9]], B) == [0, 8]


def test_distinct_prefix_blocks_counts_shared_blocks_only():
    a = list(range(12))
    b = list(range(8)) + [50, 51, 52, 53]
    assert ca.distinct_prefix_blocks([a, b, [9] * 8], B) == 2
    assert ca.distinct_prefix_blocks([a], B) == 0


def test_cold_requests_are_the_first_of_each_prefix_and_warn_above_a_tenth():
    groups = [[g] * 8 + [100 + i, 101 + i] for g in range(2) for i in range(5)]
    # 2 prefixes x 5 requests: the first of each.
    assert sc.cold_requests(ca.oracle_cached_tokens(groups, B)) == 2
    assert sc.cold_share_warning({"cold_requests": 2, "num_requests": 10}).startswith(
        "2 of 10 requests (20%) are cold"
    )
    assert sc.cold_share_warning({"cold_requests": 1, "num_requests": 10}) is None
    assert sc.cold_share_warning({"num_requests": 10}) is None  # loadgen: no token ids


def test_placement_counts_a_prefix_once_per_replica_it_was_sent_to():
    a = list(range(8)) + [90, 91]  # 2 shared blocks + its own tokens
    b = list(range(8)) + [80, 81]
    c = list(range(8)) + [70, 71]
    # All on one replica: the placement is the oracle.
    assert ca.placement_cached_tokens([a, b, c], ["r1"] * 3, B) == [0, 8, 8]
    # The second sent elsewhere prefills the prefix again; the third hits where the first ran.
    assert ca.placement_cached_tokens([a, b, c], ["r1", "r2", "r1"], B) == [0, 0, 8]
    # A request whose replica is unknown hits nothing and seeds nothing.
    assert ca.placement_cached_tokens([a, b, c], [None, None, "r1"], B) == [0, 0, 0]


def test_cache_breakdown_splits_the_shortfall_into_placement_and_after_routing():
    a = list(range(8)) + [90, 91]
    b = list(range(8)) + [80, 81]
    c = list(range(8)) + [70, 71]
    d = [5] * 10  # shares nothing
    got = ca.cache_breakdown([a, b, c, d], ["r1", "r2", "r1", "r2"], [0, 0, 4, None], B)
    assert got["oracle_cached_tokens"] == 16  # b and c hit both blocks
    assert got["placement_cached_tokens"] == 8  # only c, on r1 after a
    assert got["served_cached_tokens"] == 4  # the engine served one of those blocks
    assert got["lost_to_placement_tokens"] == 8
    assert got["lost_after_routing_tokens"] == 4
    # Shared blocks per replica: both were sent a, b or c's 2 blocks; d's are nobody's twice.
    assert got["shared_prefix_blocks_by_replica"] == {"r1": 2, "r2": 2}


def _row(policy, tok_s, p50, p90, p99, served=None, size=2, workload="engine", failed=0):
    return {
        "workload": workload,
        "replicas": size,
        "policy": policy,
        "completed": 64 - failed,
        "failed": failed,
        "output_throughput": tok_s,
        "median_ttft_ms": p50,
        "p90_ttft_ms": p90,
        "p99_ttft_ms": p99,
        "cached_token_ratio": 0.5,
        "total_cached_tokens": 1000,
        "oracle_cached_tokens": None if served is None else 1000,
        "served_of_oracle": served,
        "replica_request_counts": {"replica-a": 32, "replica-b": 32},
        "max_mean_load": 1.0,
    }


def test_verdict_passes_only_when_prefix_beats_every_rival_on_every_figure():
    rows = [
        _row("prefix", 60.0, 100, 200, 300, served=0.95),
        _row("round_robin", 50.0, 150, 250, 350),
        _row("least_loaded", 55.0, 120, 220, 320),
    ]
    v = report.verdict(rows)
    assert v["passed"] and all(v["figures"].values()) and v["oracle"] is True
    # One rival ahead on one figure (p99) fails that figure and the verdict.
    rows[2] = _row("least_loaded", 55.0, 120, 220, 290)
    v = report.verdict(rows)
    assert not v["passed"] and v["figures"] == {
        "tok/s": True,
        "p50": True,
        "p90": True,
        "p99": False,
    }
    # A tie is not a win.
    rows[2] = _row("least_loaded", 60.0, 120, 220, 320)
    assert not report.verdict(rows)["figures"]["tok/s"]


def test_verdict_needs_ninety_percent_of_the_oracle_and_no_failures():
    rivals = [_row("round_robin", 50.0, 150, 250, 350)]
    assert not report.verdict([_row("prefix", 60.0, 1, 2, 3, served=0.89), *rivals])["passed"]
    assert report.verdict([_row("prefix", 60.0, 1, 2, 3, served=0.90), *rivals])["passed"]
    with_failures = _row("prefix", 60.0, 1, 2, 3, served=0.99, failed=1)
    assert not report.verdict([with_failures, *rivals])["passed"]
    errored = {"workload": "engine", "replicas": 2, "policy": "prefix", "error": "not healthy"}
    assert not report.verdict([errored, *rivals])["passed"]


def test_markdown_has_one_table_per_workload_and_the_verdict_on_prefix_rows():
    rows = [
        _row("prefix", 60.0, 100, 200, 300, served=0.95),
        _row("round_robin", 50.0, 150, 250, 350, served=0.5),
        _row("prefix", 40.0, 100, 200, 300, served=0.80, size=3, workload="overflow"),
        _row("round_robin", 50.0, 150, 250, 350, served=0.4, size=3, workload="overflow"),
        {"workload": "overflow", "replicas": 3, "policy": "least_loaded", "error": "boom"},
    ]
    text = report.markdown(rows)
    assert text.count("### ") == 2 and "### engine" in text and "### overflow" in text
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    prefix_2 = next(line for line in lines if line.startswith("| 2 | prefix"))
    assert "PASS: beats all on tok/s, p50, p90, p99; oracle >= 90%" in prefix_2
    assert "95.0%" in prefix_2 and "100 / 200 / 300" in prefix_2
    prefix_3 = next(line for line in lines if line.startswith("| 3 | prefix"))
    assert "FAIL" in prefix_3 and "not on tok/s" in prefix_3 and "oracle < 90%" in prefix_3
    assert "error: boom" in text
    header_cells = lines[0].count("|")
    assert all(line.count("|") == header_cells for line in lines), "ragged table"


def test_repeats_are_summarized_by_their_medians_and_the_verdict_compares_those():
    runs = [
        # prefix wins two of three runs on tok/s, loses one badly: the median still wins
        {**_row("prefix", 60.0, 100, 200, 300, served=0.95), "repeat": 1},
        {**_row("round_robin", 55.0, 150, 250, 350, served=0.5), "repeat": 1},
        {**_row("prefix", 40.0, 110, 190, 310, served=0.93), "repeat": 2},
        {**_row("round_robin", 50.0, 160, 260, 340, served=0.5), "repeat": 2},
        {**_row("prefix", 58.0, 90, 210, 290, served=0.97), "repeat": 3},
        {**_row("round_robin", 57.0, 140, 240, 360, served=0.5), "repeat": 3},
        {"workload": "engine", "replicas": 2, "policy": "round_robin", "error": "x", "repeat": 4},
    ]
    summary = report.summarize(runs)
    assert [r["policy"] for r in summary] == ["prefix", "round_robin"]
    prefix, rr = summary
    assert prefix["runs"] == 3 and rr["runs"] == 3  # the errored run is left out
    assert prefix["output_throughput"] == 58.0 and prefix["median_ttft_ms"] == 100
    assert prefix["ranges"]["output_throughput"] == [40.0, 60.0]
    assert prefix["served_of_oracle"] == 0.95 and prefix["completed"] == 3 * 64
    assert rr["output_throughput"] == 55.0
    assert "requests" not in prefix and prefix["replica_request_counts"] is None
    assert report.verdict(summary)["passed"]  # yet run 2 alone would fail on tok/s
    assert not report.verdict([r for r in runs if r.get("repeat") == 2])["passed"]
    # One run: the row as it is; a cell whose runs all errored: its error row.
    single = report.summarize([_row("prefix", 1.0, 1, 2, 3)])[0]
    assert single["runs"] == 1 and single["replica_request_counts"] == {
        "replica-a": 32,
        "replica-b": 32,
    }
    errored = {"workload": "engine", "replicas": 2, "policy": "prefix", "error": "boom"}
    assert report.summarize([errored, dict(errored)]) == [errored]
    table = report.markdown(summary)
    assert "| 3 runs |" in table and "PASS" in table
    runs_table = report.runs_markdown(runs).splitlines()
    assert len(runs_table) == 2 + len(runs) and "error: x" in runs_table[-1]
    assert all(line.count("|") == runs_table[0].count("|") for line in runs_table[:-1])


def test_busy_fraction_is_the_share_of_the_run_a_replica_had_a_request_open():
    def req(replica, start_s, latency_s):
        return {"replica": replica, "start_s": start_s, "latency_s": latency_s}

    # The run spans 0-10 s. a: open 0-4 and 3-6 (overlapping) then 8-10 -> 8 s; b: 2-3 -> 1 s.
    reqs = [req("a", 0.0, 4.0), req("a", 3.0, 3.0), req("b", 2.0, 1.0), req("a", 8.0, 2.0)]
    assert report.busy_fractions(reqs) == {"a": 0.8, "b": 0.1}
    assert report.busy_fractions([]) == {}
    assert "| 0.80 0.10 |" in report.runs_markdown(
        [{**_row("prefix", 1.0, 1, 2, 3), "replica_busy_fraction": {"a": 0.8, "b": 0.1}}]
    )


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        _row(p, 50.0 + i, 100, 200, 300, served=0.9, size=s)
        for i, p in enumerate(sc.POLICIES)
        for s in (2, 3)
    ]
    path = tmp_path / "x.png"
    report.plot(rows, path, "test")
    assert path.read_bytes()[:4] == b"\x89PNG"
    repeated = report.summarize([{**r, "repeat": k} for r in rows for k in (1, 2)])
    report.plot(repeated, tmp_path / "ranges.png", "test")  # error bars from the runs' ranges
    assert (tmp_path / "ranges.png").read_bytes()[:4] == b"\x89PNG"


def test_arguments_defaults_and_quick():
    args = sc.parse_args([])
    assert args.workload == ["engine", "overflow"] and args.replicas == [2, 3]
    assert args.policies == list(sc.POLICIES) and args.concurrency == 8
    assert args.num_kv_blocks == sc.OVERFLOW_NUM_KV_BLOCKS
    assert "--num-kv-blocks 320" in sc.engine_flags(args)
    assert args.repeats == 1
    with pytest.raises(SystemExit):
        sc.parse_args(["--repeats", "0"])
    quick = sc.parse_args(["--quick"])
    assert quick.replicas == [2] and quick.tag.endswith("_quick")
    engine_only = sc.parse_args(["--workload", "engine", "--replicas", "3"])
    assert engine_only.num_kv_blocks is None and "--num-kv-blocks" not in sc.engine_flags(
        engine_only
    )
    with pytest.raises(SystemExit):
        sc.parse_args(["--workload", "nope"])


def test_serving_replicas_counts_the_engine_replicas_in_metrics():
    from bench.cluster_process import serving_replicas
    from cluster.metrics_render import render_prometheus

    assert serving_replicas(render_prometheus({}, {}).decode()) == 0
    replicas = {"k78xttnw": {"model_name": "smollm2"}, "kvs1tr9q": {"model_name": "smollm2"}}
    assert serving_replicas(render_prometheus(replicas, {}).decode()) == 2


def test_arrivals_during_prefill_counts_requests_that_met_another_before_its_first_token():
    def req(replica, start_s, ttft_s):
        return {"replica": replica, "start_s": start_s, "ttft_s": ttft_s}

    # a1 awaits its first token 0-1 s: a2 (at 0.5 s) meets it, a3 (at 2 s) does not; b1 is
    # alone on b, and a request never meets itself.
    reqs = [req("a", 0.0, 1.0), req("a", 0.5, 0.3), req("b", 0.6, 0.9), req("a", 2.0, 0.1)]
    assert report.arrivals_during_prefill(reqs) == {
        "share": 0.25,
        "ttft_ms_met": 300.0,
        "ttft_ms_clear": 900.0,
    }
    assert report.arrivals_during_prefill([]) is None
    row = {
        **_row("prefix", 1.0, 1, 2, 3),
        "arrivals_during_prefill": {"share": 0.25, "ttft_ms_met": 300.0, "ttft_ms_clear": None},
    }
    assert "| 25% (300 / -) |" in report.runs_markdown([row])


def test_kv_dtypes_share_the_bytes_and_get_their_own_tables_and_a_side_by_side_one():
    args = sc.parse_args(
        ["--workload", "overflow", "--kv-cache-dtypes", "auto", "int8"]
        + ["--kv-cache-bytes", str(320 * 737280)]
    )
    assert args.num_kv_blocks is None  # the bytes, not a block count, are held equal
    assert sc.engine_flags(args, "int8").endswith(
        "--kv-cache-bytes 235929600 --kv-cache-dtype int8"
    )
    assert "--kv-cache-dtype" not in sc.engine_flags(args, "auto")
    # SmolLM2: 30 layers x 3 KV heads x 16 tokens x K and V; float32 rows of 64 x 4 bytes,
    # int8 rows of 64 values and a 2-byte scale.
    assert sc.kv_blocks_per_replica(args, "auto") == 320
    assert sc.kv_blocks_per_replica(args, "int8") == 320 * 737280 // (2 * 30 * 3 * 66 * 16)
    with pytest.raises(SystemExit):
        sc.parse_args(["--kv-cache-bytes", "1000", "--num-kv-blocks", "4"])

    rows = [
        {**_row("prefix", 60.0, 100, 200, 300, served=0.7), "kv_cache_dtype": "auto"},
        {**_row("round_robin", 50.0, 150, 250, 350, served=0.5), "kv_cache_dtype": "auto"},
        {**_row("prefix", 65.0, 90, 150, 300, served=0.95), "kv_cache_dtype": "int8"},
        {**_row("round_robin", 55.0, 95, 180, 350, served=0.9), "kv_cache_dtype": "int8"},
    ]
    for r in rows:
        r["kv_blocks_per_replica"] = 320 if r["kv_cache_dtype"] == "auto" else 1241
    text = report.markdown(rows)
    assert "### engine\n" in text and "### engine, KV int8\n" in text
    assert set(report.groups(rows)) == {("engine", 2), ("engine, KV int8", 2)}
    side = report.kv_dtype_markdown(rows)
    lines = side.splitlines()[2:]
    assert lines[0].startswith("| engine | 2 | prefix | auto | 320 | 70.0% | 100 / 200 |")
    assert lines[1].startswith("| engine | 2 | prefix | int8 | 1241 | 95.0% | 90 / 150 |")
    assert report.kv_dtype_markdown(rows[:2]) == ""  # one dtype: no side-by-side table
