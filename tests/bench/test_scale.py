"""bench/scale.py and bench/scale_report.py without Ray: the workload's token ids, the time
scale and rates, the row math, the /metrics histogram, and the report files (no cluster
starts)."""

from __future__ import annotations

import json
import math

import pytest

from bench import scale, scale_report, scale_resimulate
from bench.sim.workloads import (
    Request,
    WorkloadScale,
    generated_shared_prefix,
    mooncake_trace,
    zipf_prefixes,
)

VOCAB = 49152  # SmolLM2's
GPU = {
    "description": "gpu",
    "source": "test",
    "prefill_tokens_per_s": 40000.0,
    "decode_step_base_s": 0.0064,
    "decode_step_per_seq_s": 0.00002,
    "decode_step_per_context_token_s": 4.4e-8,
    "kv_bytes_per_token": 131072,
    "kv_capacity_tokens": 440000,
    "host_to_device_bytes_per_s": 2.5e10,
    "kv_transfer_bytes_per_s": 4.0e10,
}


def _scale(n: int = 8, seed: int = 0) -> WorkloadScale:
    return WorkloadScale(num_replicas=n, capacity_blocks=512, requests_per_replica=6, seed=seed)


def _common_blocks(a: Request, b: Request) -> int:
    return scale.shared_prefix_len(a.block_ids, b.block_ids)


def test_block_tokens_are_deterministic_in_vocabulary_and_distinct():
    first = scale.block_token_ids(12345, VOCAB)
    scale.block_token_ids.cache_clear()
    assert scale.block_token_ids(12345, VOCAB) == first  # not the cache's doing
    assert len(first) == scale.BLOCK_SIZE
    ids = [scale.block_token_ids(b, VOCAB) for b in range(0, 3000)]
    assert all(scale.TOKEN_LO <= t < VOCAB for block in ids for t in block)
    assert len(set(ids)) == len(ids)
    m = VOCAB - scale.TOKEN_LO
    # ids M apart share their first token and differ in the second
    a, b = scale.block_token_ids(5, VOCAB), scale.block_token_ids(5 + m, VOCAB)
    assert a[0] == b[0] and a[1] != b[1]
    assert scale.block_token_ids(5, 2000) != scale.block_token_ids(5, VOCAB)
    with pytest.raises(ValueError):
        scale.block_token_ids(-1, VOCAB)


@pytest.mark.parametrize("make", [generated_shared_prefix, zipf_prefixes, mooncake_trace])
def test_prompts_share_exactly_the_blocks_their_requests_share(make):
    wl = make(_scale())
    prompts = [scale.prompt_token_ids(r, VOCAB) for r in wl.requests]
    assert [len(p) for p in prompts] == [r.num_prompt_tokens for r in wl.requests]
    assert prompts == [scale.prompt_token_ids(r, VOCAB) for r in make(_scale()).requests]
    reqs = wl.requests
    pairs = [(i, j) for i in range(len(reqs)) for j in range(i + 1, min(len(reqs), i + 12))]
    shared_some = 0
    for i, j in pairs:
        k = _common_blocks(reqs[i], reqs[j])
        full = min(len(reqs[i].block_ids), len(reqs[j].block_ids))
        if k == full:  # one's blocks lead the other's: the tails decide, not checked
            continue
        assert scale.shared_prefix_len(prompts[i], prompts[j]) == k * scale.BLOCK_SIZE, (i, j)
        shared_some += k > 0
    assert shared_some > 0  # the workload does share prefixes


def test_prompt_tail_is_the_requests_own_and_never_a_full_block():
    req = Request(3, 0.0, (1, 2), 2 * 16 + 7, 8)
    ids = scale.prompt_token_ids(req, VOCAB)
    assert len(ids) == 39 and ids[:32] == [*scale.block_token_ids(1, VOCAB),
                                           *scale.block_token_ids(2, VOCAB)]  # fmt: skip
    other = scale.prompt_token_ids(Request(4, 0.0, (1, 2), 39, 8), VOCAB)
    assert other[:32] == ids[:32] and other[32:] != ids[32:]
    assert all(scale.TOKEN_LO <= t < VOCAB for t in ids)
    with pytest.raises(ValueError):
        scale.prompt_token_ids(Request(5, 0.0, (1, 2), 20, 8), VOCAB)


def test_time_scale_puts_the_offered_load_at_the_rate():
    cap = scale.capacity_req_per_s(40000.0, 8, 1152.0)
    assert cap == pytest.approx(8 * 40000 / 1152)
    s = scale.auto_time_scale(40000.0, 8, 1152.0, 0.8, 6.0)
    assert s == pytest.approx(0.8 * cap / 6.0)
    assert 0.8 * scale.capacity_req_per_s(40000.0 / s, 8, 1152.0) == pytest.approx(6.0)
    assert scale.auto_time_scale(40000.0, 1, 1152.0, 0.8, 1000.0) == 1.0  # never sped up
    assert scale.auto_time_scale(40000.0, 32, 1152.0, 0.8, 6.0) == pytest.approx(4 * s)


def test_scaled_profile_multiplies_every_time():
    slow = scale.scaled_profile(GPU, 10.0)
    assert slow["prefill_tokens_per_s"] == pytest.approx(4000.0)
    assert slow["host_to_device_bytes_per_s"] == pytest.approx(2.5e9)
    assert slow["kv_transfer_bytes_per_s"] == pytest.approx(4.0e9)
    assert slow["decode_step_base_s"] == pytest.approx(0.064)
    assert slow["decode_step_per_context_token_s"] == pytest.approx(4.4e-7)
    assert slow["kv_bytes_per_token"] == GPU["kv_bytes_per_token"]
    assert slow["kv_capacity_tokens"] == GPU["kv_capacity_tokens"]
    from worker.sim_model import SimProfile

    base = SimProfile(name="gpu", **GPU)
    slowed = SimProfile(name="x", **slow)
    assert slowed.step_seconds(300, 7, 7 * 500) == pytest.approx(
        10 * base.step_seconds(300, 7, 7 * 500)
    )
    assert slowed.transfer_seconds(1024) == pytest.approx(10 * base.transfer_seconds(1024))


def test_kv_pulls_reach_the_prefix_cells_cluster_and_simulator_at_one_rate(tmp_path):
    """With ``--kv-pulls`` the prefix policy's cluster gets the simulator's pull price and the
    simulator the profile's transfer rate; the cache-blind policies (which never order a
    pull) get neither."""
    from bench.sim.ours import PULL_PRICE_FACTOR

    argv = ["--replicas", "8", "--index", "embedded", "--out-dir", str(tmp_path), "--kv-pulls"]
    args = scale.parse_args(argv)
    plan = scale.plan_cell(args, GPU, 8, "generated_shared_prefix")
    tokens_per_s = plan.profile["kv_transfer_bytes_per_s"] / GPU["kv_bytes_per_token"]
    prefix = scale.server_argv(args, plan, "prefix", 8000, "p.json", None)
    flag = prefix.index("--kv-pull-tokens-per-s")
    assert float(prefix[flag + 1]) == pytest.approx(tokens_per_s / PULL_PRICE_FACTOR, rel=1e-3)
    assert "--kv-pull-tokens-per-s" not in scale.server_argv(
        args, plan, "round_robin", 8000, "p.json", None
    )
    rates = scale.pull_rates(plan.profile)
    assert rates.pull_tokens_per_s == pytest.approx(tokens_per_s)
    assert scale.pulls_on(args, "prefix") and not scale.pulls_on(args, "pow2")
    off = scale.parse_args(argv[:-1])
    assert not scale.pulls_on(off, "prefix")
    assert "--kv-pull-tokens-per-s" not in scale.server_argv(
        off, plan, "prefix", 8000, "p.json", None
    )


def test_engine_rates_match_the_profile_step_at_the_mean_context():
    from worker.sim_model import SimProfile

    ctx = 1184.0
    rates = scale.engine_rates(GPU, ctx, "test")
    profile = SimProfile(name="gpu", **GPU)
    for n in (1, 4, 64):
        assert rates.decode_step_s(n) == pytest.approx(profile.step_seconds(0, n, n * ctx))
    assert rates.prefill_tokens_per_s == 40000.0
    assert rates.host_to_device_tokens_per_s == pytest.approx(2.5e10 / 131072)
    assert rates.max_num_batched_tokens == 512


def test_plan_cell_arrivals_at_the_rate_and_same_requests(tmp_path):
    args = scale.parse_args(["--replicas", "8", "--index", "embedded", "--out-dir", str(tmp_path)])
    args.requests_per_replica = 10
    plan = scale.plan_cell(args, GPU, 8, "generated_shared_prefix")
    reqs = plan.workload.requests
    assert len(reqs) == 80 and plan.rate_req_per_s == pytest.approx(args.rate)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert 0.4 * args.rate < (len(reqs) - 1) / span < 2.5 * args.rate  # Poisson at the rate
    # the same requests the simulator's own workload at this size and seed has
    plain = generated_shared_prefix(
        WorkloadScale(num_replicas=8, capacity_blocks=512, requests_per_replica=10)
    )
    assert [r.block_ids for r in reqs] == [r.block_ids for r in plain.requests]
    fixed = scale.parse_args(["--time-scale", "1", "--index", "embedded"])
    fixed.requests_per_replica = 10
    assert scale.plan_cell(fixed, GPU, 8, "generated_shared_prefix").time_scale == 1.0
    assert plan.speculative_ttl_s == pytest.approx(max(5.0, 8192 / (40000 / plan.time_scale)))


def test_flags():
    args = scale.parse_args(["--index", "embedded"])
    assert args.replicas == [8, 16, 32] and args.policies == list(scale.POLICIES)
    assert args.workloads == ["generated_shared_prefix"] and args.time_scale == "auto"
    for bad in (["--time-scale", "0.5"], ["--time-scale", "x"], ["--policies", "random"],
                ["--replicas", "0"], ["--rate", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            scale.parse_args(bad)


def test_server_command_line(tmp_path):
    args = scale.parse_args(["--index", "embedded"])
    plan = scale.plan_cell(args, GPU, 16, "generated_shared_prefix")
    argv = scale.server_argv(args, plan, "pow2", 8123, tmp_path / "p.json", "redis://x:1/0")
    flags = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert argv[1:3] == ["-m", "cluster.cli"] and argv[3] == "serve"  # a command line only
    assert flags["--num-replicas"] == "16" and flags["--routing"] == "pow2"
    assert flags["--engine"] == "sim" and flags["--sim-profile"].endswith("p.json")
    assert float(flags["--num-cpus-per-replica"]) * 16 < 2
    assert argv[-2:] == ["--redis-url", "redis://x:1/0"]


def _record(replica, prompt, cached, ttft, ok=True, out=4):
    return {
        "success": ok,
        "error": "" if ok else "HTTP 500: boom",
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": out,
        "ttft_s": ttft,
        "replica": replica,
    }


def test_summary_row_math():
    records = [
        _record("a", 100, 50, 0.1),
        _record("a", 100, 100, 0.2),
        _record("b", 200, 0, 0.3),
        _record("a", 100, None, 0.4),
        _record("b", 999, 999, 9.0, ok=False, out=0),
    ]
    row = scale_report.summarize_records(records, 4, 2.0)
    assert row["hit_rate"] == pytest.approx(150 / 500)
    assert (row["completed"], row["failed"]) == (4, 1)
    assert row["errors"] == ["HTTP 500: boom"]
    assert row["requests_per_replica"] == [3, 1, 0, 0] and row["replicas_used"] == 2
    assert row["max_mean_load"] == pytest.approx(3 / 1.0)
    assert row["ttft_p50_s"] == pytest.approx(0.25)
    assert row["ttft_p90_s"] == pytest.approx(0.37)
    assert row["output_tok_s"] == pytest.approx(16 / 2.0)
    empty = scale_report.summarize_records([_record("a", 1, 0, 1.0, ok=False)], 2, 1.0)
    assert empty["hit_rate"] is None and empty["ttft_p90_s"] is None
    assert empty["max_mean_load"] is None


def test_relative_differences():
    assert scale_report.rel_diff(1.2, 1.0) == pytest.approx(0.2)
    assert scale_report.rel_diff(0.5, 1.0) == pytest.approx(-0.5)
    assert scale_report.rel_diff(1.0, 0.0) is None and scale_report.rel_diff(None, 1.0) is None
    diffs = scale_report.compare(
        {"hit_rate": 0.6, "ttft_p50_s": 2.0, "ttft_p90_s": 3.0},
        {"hit_rate": 0.8, "ttft_p50_s": 1.0, "ttft_p90_s": 3.0},
    )
    assert diffs == pytest.approx(
        {"rel_diff_hit_rate": -0.25, "rel_diff_ttft_p50_s": 1.0, "rel_diff_ttft_p90_s": 0.0}
    )


METRICS = """# HELP prefixserve:router_lookup_latency_seconds Prefix index lookup latency.
# TYPE prefixserve:router_lookup_latency_seconds histogram
prefixserve:router_lookup_latency_seconds_bucket{le="0.0005"} %d
prefixserve:router_lookup_latency_seconds_bucket{le="0.001"} %d
prefixserve:router_lookup_latency_seconds_bucket{le="0.005"} %d
prefixserve:router_lookup_latency_seconds_bucket{le="+Inf"} %d
prefixserve:router_lookup_latency_seconds_sum %f
prefixserve:router_lookup_latency_seconds_count %d
prefixserve:router_lookup_latency_seconds_other 7
"""


def test_lookup_histogram_from_metrics():
    name = "prefixserve:router_lookup_latency_seconds"
    before = scale_report.histogram_from_metrics(METRICS % (1, 2, 2, 2, 0.001, 2), name)
    after = scale_report.histogram_from_metrics(METRICS % (3, 60, 101, 102, 0.101, 102), name)
    assert after["buckets"][math.inf] == 102 and after["count"] == 102
    delta = scale_report.histogram_delta(after, before)
    assert delta["count"] == 100 and delta["buckets"][0.001] == 58
    summary = scale_report.histogram_summary(delta)
    assert summary["mean_ms"] == pytest.approx(1.0)
    assert summary["p50_le_ms"] == pytest.approx(1.0) and summary["p99_le_ms"] == pytest.approx(5)
    assert summary["share_above_5_ms"] == pytest.approx(0.01)  # 99 of 100 within 5 ms
    assert scale_report.histogram_summary({"buckets": {}, "sum": 0, "count": 0})["mean_ms"] is None


def test_counter_from_metrics_sums_the_replicas():
    text = (
        "# TYPE prefixserve:num_preemptions_total counter\n"
        'prefixserve:num_preemptions_total{replica="a"} 2.0\n'
        'prefixserve:num_preemptions_total{replica="b"} 5.0\n'
        "prefixserve:num_preemptions_total_other 9.0\n"
    )
    assert scale_report.counter_from_metrics(text, scale.PREEMPTIONS) == 7.0
    assert scale_report.counter_from_metrics("", scale.PREEMPTIONS) == 0.0


def test_cpu_rates_by_kind():
    from bench.serve_path import cpu_kind

    before = {"ray::ServeReplica:prefixserve:EngineReplica": 10.0, "gcs_server": 1.0}
    after = {
        "ray::ServeReplica:prefixserve:EngineReplica": 12.0,
        "python -m worker.engine_process": 1.0,
        "gcs_server": 1.5,
    }
    rates = scale_report.cpu_rates(before, after, 10.0, cpu_kind)
    assert rates == pytest.approx({"replica": 0.2, "engine": 0.1, "ray": 0.05})


def _row(n, policy, hit, p90, error=None):
    row = {
        "replicas": n,
        "index": "embedded",
        "workload": "generated_shared_prefix",
        "policy": policy,
        "time_scale": 37.0,
        "rate_req_per_s": 6.0,
        "sim": {
            "hit_rate": hit + 0.01,
            "preemptions": 7,
            "ttft_p50_s": 0.5,
            "ttft_p90_s": (p90 or 2.0) / 2,
            "ttft_p99_s": 3.0,
            "max_mean_load": 1.1,
        },  # fmt: skip
    }
    if error:
        row["error"] = error
        return row
    row.update(
        completed=10, failed=0, hit_rate=hit, ttft_p50_s=0.6, ttft_p90_s=p90, ttft_p99_s=4.0,
        max_mean_load=1.2, preemptions=3, startup_s=60.0,
        router_lookup={"count": 9, "mean_ms": 0.8, "p50_le_ms": 1.0, "p99_le_ms": None,
                       "last_bucket_ms": 100.0},
        load_cpu_s_per_s={"ingress": 0.5, "replica": 0.75}, send_lateness_p99_s=0.05,
        memory_used_mb=7000,
        idle_cpu_s_per_s_per_engine_replica=0.024, idle_cpu_s_per_s_total=0.4,
    )  # fmt: skip
    row.update(scale_report.compare(row, row["sim"]))
    return row


def test_report_files(tmp_path):
    rows = [
        _row(8, "prefix", 0.8, 1.0),
        _row(16, "prefix", 0.78, 1.5),
        _row(8, "round_robin", 0.45, 3.0),
        _row(16, "round_robin", 0.3, None, error="RuntimeError: not healthy"),
    ]
    older = rows[2]["sim"]  # a file from before the simulator modelled preemption
    older["overflow_blocks"] = older.pop("preemptions")
    header = {"machine": "CPU X (2 CPUs)", "date": "d", "command": "python -m bench.scale"}
    paths = scale_report.write_report(tmp_path, "t", header, rows)
    assert [p.name for p in paths] == ["scale_t.json", "scale_t.md", "scale_t.png"]
    data = json.loads((tmp_path / "scale_t.json").read_text())
    assert data["header"] == header and len(data["rows"]) == 4
    md = (tmp_path / "scale_t.md").read_text()
    assert "CPU X (2 CPUs)" in md and "error: RuntimeError: not healthy" in md
    prefix8 = next(line for line in md.splitlines() if line.startswith("| 8 | embedded | g"))
    assert "0.800 / 0.810" in prefix8 and "-1% / +20% / +100%" in prefix8
    assert "| 3 / 7 |" in prefix8
    round_robin8 = next(line for line in md.splitlines() if "| round_robin |" in line)
    assert "| 3 / 7 overflow |" in round_robin8
    host8 = [line for line in md.splitlines() if line.startswith("| 8 | embedded | g")][-1]
    assert host8 != prefix8 and "0.8 / 1 / >100 |" in host8 and "| 1.25 | 0.05 | 7000 |" in host8
    header_cells = md.splitlines()[6].count("|")
    assert all(line.count("|") == header_cells for line in md.splitlines()[6:12])
    assert (tmp_path / "scale_t.png").stat().st_size > 1000
    only_errors = scale_report.write_report(tmp_path, "e", header, rows[3:])
    assert [p.suffix for p in only_errors] == [".json", ".md"]


def test_memory_check_refuses_a_size_that_does_not_fit():
    fits = 8 * 700 + scale.MEMORY_HEADROOM_MB
    assert scale.memory_shortfall(8, 700, fits) is None
    short = scale.memory_shortfall(32, 700, fits)
    assert short is not None and "32 replicas" in short and "not started" in short


def test_resimulate_puts_the_simulator_now_beside_a_files_real_cells(tmp_path):
    command = "python -m bench.scale --replicas 2 --policies prefix --requests-per-replica 3"
    row = {
        "replicas": 2, "policy": "prefix", "index": "embedded",
        "workload": "generated_shared_prefix",
        "hit_rate": 0.5, "ttft_p50_s": 1.0, "ttft_p90_s": 2.0,
        "sim": {"hit_rate": 0.25, "ttft_p50_s": 0.5, "ttft_p90_s": 4.0},
    }  # fmt: skip
    made = tmp_path / "scale_x.json"
    made.write_text(json.dumps({"header": {"command": command}, "rows": [row, {"error": "x"}]}))
    merged = tmp_path / "scale_merged.json"
    merged.write_text(json.dumps({"header": {"command": f"{command}; {command}"}, "rows": [row]}))
    paths = scale_resimulate.resimulate([made, merged], tmp_path / "out", "t")
    out = json.loads(paths[0].read_text())["rows"]
    assert len(out) == 1  # the error row and the file of two commands are skipped
    assert out[0]["real"] == {"hit_rate": 0.5, "ttft_p50_s": 1.0, "ttft_p90_s": 2.0}
    assert out[0]["sim_then"]["ttft_p90_s"] == 4.0
    assert 0 <= out[0]["sim_now"]["hit_rate"] <= 1 and out[0]["sim_now"]["ttft_p50_s"] > 0
    assert "| scale_x.json | 2 | prefix | embedded |" in paths[1].read_text()
    assert "+100% -> " in paths[1].read_text()  # p50: real 1.0 against 0.5 then
