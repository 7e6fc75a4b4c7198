"""The load generator against a real HTTP server (a streaming OpenAI-compatible test double on
a free loopback port): vLLM-format output, cached-token ratio, replica counts, multi-turn
history, fixed concurrency, seeds, and failed requests."""

import json

import pytest

from bench.loadgen.cli import main
from tests.bench.openai_double import BAD_MODEL, OpenAIDouble

VLLM_KEYS = {
    "date",
    "backend",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    "mean_ttft_ms",
    "median_ttft_ms",
    "std_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
}


@pytest.fixture(scope="module")
def server():
    with OpenAIDouble() as double:
        yield double


def _run(server, tmp_path, *extra):
    argv = [
        "--base-url",
        server.base_url,
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "out.json",
        "--disable-tqdm",
        *extra,
    ]
    code = main(argv)
    return code, json.loads((tmp_path / "out.json").read_text())


def test_shared_prefix_run_reports_vllm_metrics_cache_ratio_and_replicas(server, tmp_path, capsys):
    code, result = _run(
        server,
        tmp_path,
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "3",
        "--gsp-system-prompt-len",
        "64",
        "--gsp-question-len",
        "8",
        "--gsp-output-len",
        "5",
        "--metric-percentiles",
        "50,90,99",
    )
    assert code == 0
    assert set(result) >= VLLM_KEYS
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 30
    assert result["model_id"] == "double-model"  # taken from GET /v1/models
    # 2 groups x 3 prompts sharing 64+ words: 4 of 6 prompts hit at least 64 cached words
    assert result["cached_token_ratio"] >= 4 * 64 / result["total_input_tokens"]
    assert sum(result["replica_request_counts"].values()) == 6
    assert set(result["replica_request_counts"]) == {"replica-0", "replica-1"}
    assert all(t > 0 for t in result["ttfts"]) and result["p90_ttft_ms"] > 0
    assert all(len(itl) == 4 for itl in result["itls"])
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    for label in (
        "Successful requests:",
        "Mean TTFT (ms):",
        "P90 TTFT (ms):",
        "Mean TPOT (ms):",
        "Median ITL (ms):",
        "Cached-token ratio:",
        "Requests on replica-0:",
    ):
        assert label in out


def test_multi_turn_chat_resends_history_with_the_servers_answers(server, tmp_path):
    server.seen.clear()
    code, result = _run(
        server,
        tmp_path,
        "--endpoint",
        "/v1/chat/completions",
        "--dataset-name",
        "multi-turn",
        "--num-prompts",
        "2",
        "--multi-turn-turns",
        "3",
        "--multi-turn-output-len",
        "3",
    )
    assert code == 0 and result["completed"] == 6
    by_system = {}
    for body in server.seen:
        by_system.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    assert len(by_system) == 2
    for turns in by_system.values():
        assert [len(m) for m in turns] == [2, 4, 6]  # system + growing user/assistant pairs
        assert turns[1][:2] == turns[2][:2] and turns[2][2]["content"] == "tok0 tok1 tok2 "
    assert result["cached_token_ratio"] > 0.3  # later turns reuse their history


def test_fixed_concurrency_is_respected(server, tmp_path):
    server.max_concurrent = 0
    code, result = _run(
        server,
        tmp_path,
        "--dataset-name",
        "random",
        "--num-prompts",
        "8",
        "--random-input-len",
        "16",
        "--random-output-len",
        "10",
        "--max-concurrency",
        "2",
    )
    assert code == 0 and result["completed"] == 8
    assert result["max_concurrent_requests"] == 2 and server.max_concurrent <= 2


def test_the_seed_makes_prompts_reproducible(server, tmp_path):
    def prompts(seed):
        server.seen.clear()
        _run(
            server,
            tmp_path,
            "--dataset-name",
            "zipf",
            "--num-prompts",
            "5",
            "--seed",
            seed,
            "--prefix-repetition-prefix-len",
            "20",
            "--prefix-repetition-output-len",
            "2",
        )
        return sorted(body["prompt"] for body in server.seen)

    assert prompts("3") == prompts("3")
    assert prompts("3") != prompts("4")


def test_failed_requests_are_counted_not_raised(server, tmp_path):
    code, result = _run(
        server,
        tmp_path,
        "--model",
        BAD_MODEL,
        "--dataset-name",
        "random",
        "--num-prompts",
        "3",
        "--random-output-len",
        "2",
    )
    assert code == 1
    assert result["completed"] == 0 and result["failed"] == 3
    assert all("HTTP 404" in e for e in result["errors"])


def test_prefixserve_bench_serve_subcommand_hook(server, tmp_path):
    import argparse

    from bench.loadgen.cli import add_parser

    parser = argparse.ArgumentParser(prog="prefixserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--dataset-name",
            "random",
            "--num-prompts",
            "2",
            "--random-output-len",
            "2",
            "--disable-tqdm",
        ]
    )
    assert ns.handler(ns) == 0


def test_serve_compare_runs_every_policy_against_a_launched_server(tmp_path):
    import sys

    from bench.serve_compare import main as compare

    launch = f"{sys.executable} -m tests.bench.openai_double --port {{port}}"
    code = compare(
        [
            "--workload",
            "loadgen",
            "--replicas",
            "2",
            "--policies",
            "prefix",
            "round_robin",
            "--repeats",
            "2",
            "--launch",
            launch,
            "--out-dir",
            str(tmp_path),
            "--tag",
            "t",
            "--log-dir",
            str(tmp_path),
            "--startup-timeout-s",
            "60",
            "--",
            "--dataset-name",
            "prefix-repetition",
            "--num-prompts",
            "4",
            "--prefix-repetition-num-prefixes",
            "1",
            "--prefix-repetition-prefix-len",
            "32",
            "--prefix-repetition-output-len",
            "2",
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "serve_compare_t.json").read_text())
    rows, summary = result["rows"], result["summary"]
    assert "| prefix |" in (tmp_path / "serve_compare_t.md").read_text()
    # Each policy twice, interleaved; one median row per policy.
    assert [(r["policy"], r["repeat"]) for r in rows] == [
        ("prefix", 1),
        ("round_robin", 1),
        ("prefix", 2),
        ("round_robin", 2),
    ]
    assert all(r["completed"] == 4 and r["cached_token_ratio"] > 0 for r in rows)
    assert [(r["policy"], r["runs"]) for r in summary] == [("prefix", 2), ("round_robin", 2)]
    assert (tmp_path / "serve_compare_t.png").stat().st_size > 0
