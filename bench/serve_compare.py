"""Real-cluster comparison of routing policies: prefix vs round robin vs least loaded.

    python bench/serve_compare.py                     # the issue's run: see below
    python bench/serve_compare.py --quick             # smoke: 2 replicas, prefix vs round robin
    python bench/serve_compare.py --workload engine --replicas 2 --policies prefix round_robin

For each cluster size in ``--replicas`` and each policy in ``--policies`` it starts a fresh
cluster with ``--launch`` (``{replicas}``, ``{policy}``, ``{port}`` and ``{engine_flags}``
filled in), waits for ``GET /health``, runs every workload of ``--workload`` on it in turn
(same requests, order and concurrency for every policy), then stops it (SIGINT, then SIGTERM).

Workloads (chat requests, greedy, ``ignore_eos``, a closed loop at ``--concurrency``):

- ``engine``: ``bench/engine.py``'s workload (``bench.loadgen.workloads``): 64 requests over 4
  system prompts of 300-500 tokens, 64 output tokens each.
- ``overflow``: prefixes that do not fit in one replica's KV cache but do fit in the cluster's.
  16 groups x 12 requests (shuffled), each group a system prompt of ~440 words (~460 tokens with
  the chat template, ~29 blocks of 16), so the distinct prefixes need ~470 blocks; every replica
  gets ``--num-kv-blocks 320``: one replica holds at most ~10 groups (fewer with the running
  requests' own blocks, ~6 each) and cycles through all 16 under a cache-blind policy, while 2
  replicas hold 640 blocks and 3 hold 960, room for every prefix once plus 8 running requests.
  The run records the real counts (``distinct_prefix_blocks``) and warns when one replica could
  hold them all. The first request of each group is cold under every policy, 1 in 12 here:
  at 4 per group a quarter of the requests would be, so every policy's p90 TTFT would be at
  least one cold prefill's time and the best policies would tie there
  (``cold_requests``; the run warns, and the report says so, when more than a tenth are cold).
  The closed loop starts with ``--concurrency`` cold requests at once, whose queue sets the top
  few TTFTs under any policy (at c=8 on 2 replicas, 6 of them are 3 s or more): the p99 of 192
  requests sits next to them.
- ``loadgen``: the load generator's own dataset, flags after ``--`` (no oracle: no token ids).

``--kv-cache-dtypes auto int8`` runs every (size, policy) cluster once per KV dtype
(``--kv-cache-dtype``), with ``--kv-cache-bytes`` in place of ``--num-kv-blocks`` so that every
dtype gets the same bytes (int8 then holds about 3.9x float32's blocks); each dtype gets its
own tables and verdicts, and a side-by-side table compares them.

``--repeats N`` runs every (size, policy) cluster N times, the policies interleaved (prefix,
round robin, least loaded, prefix, ...) so that a drift in the shared machine's speed lands on
every policy alike; each figure is then the median of the N runs (the table lists every run
too, and the plot draws the min-max range), and the verdict compares the medians.

Reported per (workload, size, policy): output tok/s, TTFT p50/p90/p99, cached-token ratio,
the cached tokens served and the oracle's (every distinct prefix block prefilled once per
cluster, from the requests' chat-template token ids: ``oracle_cached_tokens``), served/oracle,
the placement's (what the replicas the requests went to would serve with caches that never
evict: ``bench/cache_accounting.py``, which splits a shortfall into routing's copies and what
the engines lost after routing), requests per replica and their max/mean. The verdict, per
(workload, size): prefix beats every other policy on output tok/s and on each TTFT
percentile, and serves >= 90% of the oracle's cached tokens. Writes
``bench/results/serve_compare_<tag>.json`` (header: machine, date, command, load averages,
per request its replica, cached tokens, start, TTFT and latency), ``.md`` (tables and
verdicts) and ``.png`` (grouped bars: sizes on the x axis, one bar per policy). Each
replica's torch runs ``--threads-per-replica`` threads.

Failure modes: a cluster that is not healthy with every engine replica serving (``/health`` and
``/metrics``) within ``--startup-timeout-s`` is stopped and its
rows carry an ``error``; the other clusters still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.cache_accounting import (
    cache_breakdown,
    distinct_prefix_blocks,
    oracle_cached_tokens,
)
from bench.cluster_process import stop_server, wait_healthy
from bench.common import free_port
from bench.loadgen import cli as loadgen_cli
from bench.result_files import result_header
from bench.serve_compare_report import (
    arrivals_during_prefill,
    busy_fractions,
    groups,
    kv_dtype_markdown,
    markdown,
    plot,
    runs_markdown,
    summarize,
    verdict,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_LAUNCH = (
    "prefixserve serve --num-replicas {replicas} --routing {policy} --port {port} "
    "--expose-replica-headers {engine_flags}"
)
POLICIES = ("prefix", "round_robin", "least_loaded")
PERCENTILES = (50.0, 90.0, 99.0)
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "mean_e2el_ms",
    "total_input_tokens",
    "total_output_tokens",
    "total_cached_tokens",
    "cached_token_ratio",
    "replica_request_counts",
)
OVERFLOW_NUM_KV_BLOCKS = 320


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple  # bench.loadgen.workloads.ChatRequest (system, user, chat-template ids)
    max_tokens: int
    description: str


def engine_workload(num_requests: int, max_tokens: int) -> Workload:
    from bench.loadgen.workloads import load_workload

    reqs = tuple(load_workload(num_requests))
    desc = f"bench/engine.py: {num_requests} requests, 4 system prompts, {max_tokens} tokens"
    return Workload("engine", reqs, max_tokens, desc)


def overflow_workload(
    num_groups: int, prompts_per_group: int, system_words: int, max_tokens: int, seed: int = 0
) -> Workload:
    from bench.loadgen.workloads import ChatRequest, generated_shared_prefix
    from worker.loader import resolve_model
    from worker.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model("smollm2").path)
    convs = generated_shared_prefix(seed, num_groups, prompts_per_group, system_words, 16, 1)
    reqs = []
    for conv in convs:
        user = conv.turns[0].user_text
        messages = [
            {"role": "system", "content": conv.system_text},
            {"role": "user", "content": user},
        ]
        ids = tuple(tokenizer.apply_chat_template(messages))
        group = int(conv.system_text.split(".", 1)[0].removeprefix("Group "))
        reqs.append(ChatRequest(conv.conversation_id, group, conv.system_text, user, ids))
    desc = (
        f"{num_groups} groups x {prompts_per_group} requests, ~{system_words}-word system "
        f"prompts, {max_tokens} tokens"
    )
    return Workload("overflow", tuple(reqs), max_tokens, desc)


def cold_requests(oracle_tokens: list[int]) -> int:
    """Requests the oracle serves nothing from cache (``oracle_tokens``: its cached tokens per
    request): the first of each prefix, which every policy must prefill in full."""
    return sum(1 for n in oracle_tokens if n == 0)


def cold_share_warning(info: dict) -> str | None:
    """Why a workload's p90 TTFT cannot rank the best policies, or None: when more than a
    tenth of its requests are cold under every policy (they pay a full prefill whatever the
    routing), no policy's p90 is below one cold prefill's time, and the best ones tie there."""
    cold, total = info.get("cold_requests"), info.get("num_requests")
    if cold is not None and total and cold / total > 0.1:
        return (
            f"{cold} of {total} requests ({cold / total:.0%}) are cold under every policy, so "
            "no policy's p90 TTFT can be below one cold prefill's time"
        )
    return None


def run_workload(args, base_url: str, workload: Workload | None, loadgen_argv) -> dict:
    """One workload against a running cluster: the load generator's result dict."""
    from bench.loadgen.client import RequestSettings, first_model, run_benchmark
    from bench.loadgen.metrics import compute_result

    if workload is None:  # the load generator's own dataset and flags
        ns = loadgen_cli.build_parser().parse_args(
            ["--base-url", base_url, "--disable-tqdm", *loadgen_argv]
        )
        return loadgen_cli.run(ns)
    model = first_model(base_url)
    settings = RequestSettings(base_url, model, "/v1/chat/completions", 0.0, True, 600.0)
    convs = [r.conversation(workload.max_tokens) for r in workload.requests]
    outputs, stats = asyncio.run(
        run_benchmark(settings, convs, max_concurrency=args.concurrency, seed=args.seed)
    )
    result = compute_result(outputs, stats, PERCENTILES)
    sent = [len(r.token_ids) for r in workload.requests]
    result["prompt_ids_match_server"] = result["input_lens"] == sent
    result["requests"] = [  # in send order, for the cache breakdown
        {
            "conversation_id": o.conversation_id,
            "replica": o.replica,
            "cached_tokens": o.cached_tokens,
            "start_s": round(o.start_s, 4),
            "ttft_s": round(o.ttft_s, 4),
            "latency_s": round(o.latency_s, 4),
        }
        for o in sorted(outputs, key=lambda o: o.start_s)
    ]
    return result


def run_cluster(
    args, replicas: int, policy: str, workloads, loadgen_argv, kv_cache_dtype: str = "auto"
) -> list[dict]:
    """One fresh cluster: every workload in turn; one row per workload."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    flags = engine_flags(args, kv_cache_dtype)
    command = args.launch.format(
        replicas=replicas, policy=policy, port=port, engine_flags=flags
    ).strip()
    log_path = args.log_dir / f"serve_compare_{args.tag}_{replicas}x_{policy}_{kv_cache_dtype}.log"
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(args.threads_per_replica)
    repo_root = str(Path(__file__).resolve().parents[1])  # the CLI imports this checkout
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    rows = []
    base = {
        "replicas": replicas,
        "policy": policy,
        "command": command,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_blocks_per_replica": kv_blocks_per_replica(args, kv_cache_dtype),
    }
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(base_url, proc, args.startup_timeout_s, replicas)
            base["startup_s"] = round(time.monotonic() - started, 1)
            for name, workload in workloads:
                load_before = os.getloadavg()
                print(f"[{replicas} x {policy}] {name} ...", file=sys.stderr, flush=True)
                result = run_workload(args, base_url, workload, loadgen_argv)
                rows.append(make_row(base, name, workload, result, replicas, args.block_size))
                rows[-1]["loadavg_before"] = [round(x, 2) for x in load_before]
                rows[-1]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        except (RuntimeError, httpx.HTTPError) as exc:
            done = {r["workload"] for r in rows}
            rows += [
                {**base, "workload": n, "error": str(exc)} for n, _ in workloads if n not in done
            ]
        finally:
            stop_server(proc)
    return rows


def make_row(base: dict, name: str, workload, result: dict, replicas: int, block_size: int):
    row = {**base, "workload": name}
    row.update({k: result.get(k) for k in SUMMARY_KEYS})
    counts = list((row.get("replica_request_counts") or {}).values())
    counts += [0] * max(0, replicas - len(counts))  # a replica that got nothing
    row["max_mean_load"] = max(counts) / (sum(counts) / len(counts)) if sum(counts) else None
    if workload is not None:
        oracle = sum(oracle_cached_tokens([r.token_ids for r in workload.requests], block_size))
        row["oracle_cached_tokens"] = oracle
        row["served_of_oracle"] = (row["total_cached_tokens"] or 0) / oracle if oracle else None
        row["prompt_ids_match_server"] = result.get("prompt_ids_match_server")
        sent = result.get("requests")
        if sent:
            row["requests"] = sent
            row["cache"] = cache_breakdown(
                [workload.requests[r["conversation_id"]].token_ids for r in sent],
                [r["replica"] for r in sent],
                [r["cached_tokens"] for r in sent],
                block_size,
            )
            row["replica_busy_fraction"] = busy_fractions(sent)
            row["arrivals_during_prefill"] = arrivals_during_prefill(sent)
    return row


def engine_flags(args, kv_cache_dtype: str = "auto") -> str:
    flags = [f"--block-size {args.block_size}"]
    if args.num_kv_blocks:
        flags.append(f"--num-kv-blocks {args.num_kv_blocks}")
    if args.kv_cache_bytes:
        flags.append(f"--kv-cache-bytes {args.kv_cache_bytes}")
    if kv_cache_dtype != "auto":
        flags.append(f"--kv-cache-dtype {kv_cache_dtype}")
    return " ".join(flags)


def kv_blocks_per_replica(args, kv_cache_dtype: str) -> int | None:
    """The KV blocks each replica's engine gets: ``--num-kv-blocks``, or ``--kv-cache-bytes``
    over the bundled model's block bytes in ``kv_cache_dtype`` (float32 on CPU, like the
    engine's ``bytes_per_block``); None when the engine sizes its cache itself."""
    if args.num_kv_blocks:
        return args.num_kv_blocks
    if not args.kv_cache_bytes:
        return None
    import torch

    from worker.loader import resolve_model
    from worker.model_runner import kv_block_bytes
    from worker.models.llama import ModelSpec

    folder = Path(resolve_model("smollm2", weights=False).path)
    spec = ModelSpec.from_hf_config(json.loads((folder / "config.json").read_text()))
    per_block = kv_block_bytes(spec, kv_cache_dtype, torch.float32, args.block_size)
    return args.kv_cache_bytes // per_block


def build_workloads(args) -> list[tuple[str, Workload | None]]:
    out = []
    for name in args.workload:
        if name == "engine":
            n, tokens = (16, 16) if args.quick else (args.engine_requests, 64)
            out.append((name, engine_workload(n, tokens)))
        elif name == "overflow":
            per_group, tokens = (2, 16) if args.quick else (args.overflow_prompts_per_group, 32)
            wl = overflow_workload(
                args.overflow_groups, per_group, args.overflow_system_words, tokens
            )
            out.append((name, wl))
        else:
            out.append((name, None))
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", nargs="+", choices=["engine", "overflow", "loadgen"])
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=None)
    p.add_argument("--replicas", type=int, nargs="+", default=None, help="default: 2 3")
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every (size, policy), interleaved; figures are their medians",
    )
    p.add_argument("--engine-requests", type=int, default=64)
    p.add_argument("--overflow-groups", type=int, default=16)
    p.add_argument(
        "--overflow-prompts-per-group",
        type=int,
        default=12,
        help="requests per group; the first of each is cold under every policy (default: 12)",
    )
    p.add_argument("--overflow-system-words", type=int, default=440)
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help=f"per replica (default: {OVERFLOW_NUM_KV_BLOCKS} with the overflow workload, "
        "else the engine's default)",
    )
    p.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        default=["auto"],
        choices=["auto", "int8", "fp8_e4m3"],
        help="run every (size, policy) cluster once per KV dtype (--kv-cache-dtype)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="per replica, instead of --num-kv-blocks: the same bytes for every KV dtype",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke: 2 replicas, prefix/round_robin")
    p.add_argument("--launch", default=DEFAULT_LAUNCH)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default=None, help="file name suffix (default: the UTC date)")
    p.add_argument("--threads-per-replica", type=int, default=1)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="server logs (not results)")
    p.add_argument("loadgen_args", nargs="*", help="with --workload loadgen: its flags after --")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    args.workload = args.workload or ["engine", "overflow"]
    args.replicas = args.replicas or ([2] if args.quick else [2, 3])
    args.policies = args.policies or (["prefix", "round_robin"] if args.quick else list(POLICIES))
    if args.kv_cache_bytes and args.num_kv_blocks:
        p.error("give --kv-cache-bytes or --num-kv-blocks, not both")
    if args.num_kv_blocks is None and not args.kv_cache_bytes and "overflow" in args.workload:
        args.num_kv_blocks = OVERFLOW_NUM_KV_BLOCKS
    if args.tag is None:
        args.tag = time.strftime("%Y%m%d", time.gmtime()) + ("_quick" if args.quick else "")
    if "--metric-percentiles" not in args.loadgen_args:
        args.loadgen_args += ["--metric-percentiles", "50,90,99"]
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    workloads = build_workloads(args)
    workload_info = {}
    for name, wl in workloads:
        if wl is None:
            continue
        prompts = [r.token_ids for r in wl.requests]
        blocks = distinct_prefix_blocks(prompts, args.block_size)
        oracle_tokens = oracle_cached_tokens(prompts, args.block_size)
        workload_info[name] = {
            "description": wl.description,
            "num_requests": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts),
            "distinct_prefix_blocks": blocks,
            "oracle_cached_tokens": sum(oracle_tokens),
            "cold_requests": cold_requests(oracle_tokens),
        }
        if name == "overflow" and args.num_kv_blocks and blocks <= args.num_kv_blocks:
            print(f"warning: {blocks} prefix blocks fit in one replica's {args.num_kv_blocks}")
        warning = cold_share_warning(workload_info[name])
        if warning:
            print(f"warning: {name}: {warning}")
    header = {
        **result_header("serve_compare", "bench/serve_compare.py", argv),
        "replicas": args.replicas,
        "policies": args.policies,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "threads_per_replica": args.threads_per_replica,
        "engine_flags": engine_flags(args),
        "kv_cache_dtypes": args.kv_cache_dtypes,
        "workloads": workload_info,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "note": "shared 2-core machine: the load averages show whether other work ran",
    }
    rows = []
    for replicas in args.replicas:
        for repeat in range(1, args.repeats + 1):
            for kv_dtype in args.kv_cache_dtypes:
                for policy in args.policies:
                    run = run_cluster(
                        args, replicas, policy, workloads, args.loadgen_args, kv_dtype
                    )
                    rows += [{**r, "repeat": repeat} for r in run]
                    write_report(args, header, rows)  # so far: an interrupted run keeps its rows
    table = write_report(args, header, rows, with_plot=True)
    print(table)
    print(f"wrote {args.out_dir / f'serve_compare_{args.tag}.json'}")
    return 0 if all("error" not in r for r in rows) else 1


def write_report(args, header: dict, rows: list[dict], with_plot: bool = False) -> str:
    """``serve_compare_<tag>.json`` and ``.md`` (and with ``with_plot`` the ``.png``) of the
    rows so far; returns the tables."""
    summary = summarize(rows)
    verdicts = [
        {"workload": w, "replicas": n, **verdict(g)} for (w, n), g in groups(summary).items()
    ]
    header = {**header, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    path = args.out_dir / f"serve_compare_{args.tag}.json"
    path.write_text(
        json.dumps(
            {"header": header, "verdicts": verdicts, "summary": summary, "rows": rows}, indent=1
        )
    )
    table = markdown(summary)
    by_dtype = kv_dtype_markdown(summary)
    if by_dtype:
        table += f"\n### By KV dtype\n\n{by_dtype}"
    if args.repeats > 1:
        table = (
            f"Medians of {args.repeats} runs per (size, policy), interleaved; the verdict "
            f"compares the medians.\n\n{table}\n### Every run\n\n{runs_markdown(rows)}"
        )
    passed = sum(v["passed"] for v in verdicts)
    cold_notes = "".join(
        f"\n\nWorkload `{name}`: {warning}."
        for name, info in header.get("workloads", {}).items()
        if (warning := cold_share_warning(info))
    )
    (args.out_dir / f"serve_compare_{args.tag}.md").write_text(
        f"# Real run: {header['date']}, {header['machine']}\n\n`{header['command']}`\n\n"
        f"{', '.join(map(str, args.replicas))} CPU replicas, {args.threads_per_replica} "
        f"thread(s) each, concurrency {args.concurrency} (closed loop), engine flags "
        f"`{header['engine_flags']}`; load average at start {header['loadavg_start']}, at end "
        f"{header['loadavg_end']}. Verdict: prefix passes {passed} of {len(verdicts)} "
        f"(workload, size) cells.{cold_notes}\n\n{table}\n"
    )
    if with_plot and any("error" not in r for r in rows):
        subtitle = (
            f"{header['machine']} {header['date']}, {args.threads_per_replica} thread/replica, "
            f"concurrency {args.concurrency}, load avg {header['loadavg_start'][0]:.1f}"
        )
        if args.repeats > 1:
            subtitle += f", median of {args.repeats} runs (bars: min-max)"
        plot(summary, args.out_dir / f"serve_compare_{args.tag}.png", subtitle)
    return table


if __name__ == "__main__":
    sys.exit(main())
