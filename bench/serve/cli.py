"""The command line: flags, their ``--quick`` defaults, and ``main``, which runs the plan.

Owns ``build_parser`` (its description is the package docstring), ``parse_args`` (fills the
defaults ``--quick`` changes, checks values, finds the default llama-server) and ``main``:
the workload, the header, one row per run, the files and the table. With the hidden
``--child-offline c`` it is the offline child instead: one run, its row on the last line.

Failure modes: bad flags exit with argparse's usage error (status 2). A run that fails is a
row with an ``error``; ``main`` returns 1 when any row has one that is not a skip. SIGTERM
unwinds like Ctrl-C so every server started is stopped on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.common import sigterm_unwinds
from bench.loadgen.workloads import load_workload, requests_for
from bench.result_files import RESULTS, result_header

from .http_load import run_http_system
from .offline import ROW_PREFIX, run_offline, run_offline_child
from .processes import REPO
from .report import markdown, write_results
from .stats import same_as_offline
from .systems import SYSTEMS, has_sglang_router, plan

DEFAULT_LLAMA_SERVER = REPO / ".tools" / "llama.cpp" / "build" / "bin" / "llama-server"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description=sys.modules[__package__].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--concurrency",
        default=None,
        help="requests in flight, comma-separated (default 1,8,64; --quick: 1,4)",
    )
    ap.add_argument(
        "--systems",
        default="offline,served,llama",
        help="subset of offline,served,llama (llama needs its binary; default all)",
    )
    ap.add_argument("--num-requests", type=int, default=None, help="default 64 (--quick: 8)")
    ap.add_argument(
        "--c1-requests", type=int, default=16, help="requests at concurrency 1 (default 16)"
    )
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 (--quick: 16)")
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch / llama.cpp threads of the one-replica systems (default 2; clusters: 1 each)",
    )
    ap.add_argument(
        "--llama-server",
        default=None,
        help=f"llama.cpp's llama-server binary (default: {DEFAULT_LLAMA_SERVER.relative_to(REPO)} "
        "when it exists; 'none' to skip)",
    )
    ap.add_argument(
        "--cluster-replicas",
        type=int,
        default=0,
        help="also run N replicas x 1 thread: prefixserve (prefix routing) and, "
        "with llama-server and "
        "sglang-router, N llama-servers behind sglang-router (default off)",
    )
    ap.add_argument("--cluster-concurrency", type=int, default=None, help="default 8 (--quick: 4)")
    ap.add_argument(
        "--num-kv-blocks", type=int, default=2048, help="KV blocks per engine (offline and served)"
    )
    ap.add_argument(
        "--serve-args",
        default="",
        help="more flags for every prefixserve serve run, e.g. '--stream-interval 4' "
        "(default none)",
    )
    ap.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="before loading each HTTP system, measure what its processes use over this many "
        "idle seconds (the server's CPU floor with no requests; default 0: off)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 8 requests, 16 tokens, concurrency 1,4"
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="server logs (default: $TMPDIR/bench_serve_<date>_logs)",
    )
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--run-timeout-s", type=float, default=1800.0, help="limit for one offline run")
    ap.add_argument("--child-offline", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    # --quick changes the defaults only; flags given explicitly win.
    quick = {"num_requests": 8, "max_tokens": 16, "concurrency": "1,4", "cluster_concurrency": 4}
    full = {"num_requests": 64, "max_tokens": 64, "concurrency": "1,8,64", "cluster_concurrency": 8}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.num_requests, args.max_tokens, args.threads, args.c1_requests) < 1:
        ap.error("--num-requests, --max-tokens, --threads and --c1-requests must be >= 1")
    if args.idle_s < 0:
        ap.error("--idle-s must be >= 0")
    try:
        args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency: comma-separated integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency: at least one value, each >= 1")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        ap.error(f"--systems: unknown {bad}; choose from {','.join(SYSTEMS)}")
    if args.llama_server is None and DEFAULT_LLAMA_SERVER.exists():
        args.llama_server = str(DEFAULT_LLAMA_SERVER)
    if args.llama_server in (None, "none"):
        args.llama_server = None
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    with sigterm_unwinds():  # the finally blocks below stop the servers this started
        return _run(args, argv)


def _run(args, argv: list[str]) -> int:
    workload = load_workload(args.num_requests)
    if args.child_offline is not None:  # child: one offline run, its row on the last line
        c = args.child_offline
        row = run_offline(
            requests_for(workload, c, args.c1_requests),
            c,
            args.max_tokens,
            args.threads,
            args.num_kv_blocks,
        )
        print(ROW_PREFIX + json.dumps(row), flush=True)
        return 0

    now = datetime.now(timezone.utc)
    args.stamp = now.strftime("%Y-%m-%d")
    stem = f"serve_{args.stamp}" + ("_quick" if args.quick else "")
    args.log_dir = args.log_dir or Path(tempfile.gettempdir()) / f"bench_{stem}_logs"
    args.log_dir.mkdir(parents=True, exist_ok=True)
    header = {
        **result_header("serve", "bench.serve", argv),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "title": f"{args.num_requests} chat requests, 4 system prompts, "
        f"{args.max_tokens} greedy tokens "
        f"(SmolLM2-135M, CPU)",
        "workload": {
            "num_requests": args.num_requests,
            "c1_requests": min(args.c1_requests, args.num_requests),
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "prompt_tokens_total": sum(len(r.token_ids) for r in workload),
            "prompt_tokens_range": [
                min(len(r.token_ids) for r in workload),
                max(len(r.token_ids) for r in workload),
            ],
        },
        "llama_server": args.llama_server if "llama" in args.systems else None,
        "threads": args.threads,
        "num_kv_blocks": args.num_kv_blocks,
        "note": "each (system, concurrency) ran in a fresh process (cold prefix cache) "
        "after one warm-up "
        "request; TTFT counts from each request's send (offline: its add_request); "
        "shared machine, see "
        "the load averages",
    }
    runs = plan(args)
    print(
        f"workload: {args.num_requests} chat requests (concurrency 1: the first "
        f"{min(args.c1_requests, args.num_requests)}), "
        f"prompt tokens {header['workload']['prompt_tokens_range']}, "
        f"{args.max_tokens} output tokens; {len(runs)} runs; logs in {args.log_dir}",
        flush=True,
    )
    rows = []
    for i, run in enumerate(runs, 1):
        reqs = requests_for(workload, run.concurrency, args.c1_requests)
        print(
            f"[{i}/{len(runs)} {time.strftime('%H:%M:%S')}] {run.label}, "
            f"concurrency {run.concurrency}, "
            f"{len(reqs)} requests",
            flush=True,
        )
        base = {
            "system": run.system,
            "label": run.label,
            "concurrency": run.concurrency,
            "num_requests": len(reqs),
            "replicas": run.replicas,
            "threads_per_replica": run.threads,
        }
        if run.kind == "offline":
            row = run_offline_child(run, args, [a for a in argv if a != "--child-offline"])
        elif run.kind.startswith("llama") and not args.llama_server:
            row = {"error": "skipped: no llama-server binary (--llama-server PATH)"}
        elif run.kind.startswith("llama") and not Path(args.llama_server).exists():
            row = {"error": f"skipped: {args.llama_server} does not exist"}
        elif run.kind == "llama-router" and not has_sglang_router():
            row = {
                "error": "skipped: sglang-router is not installed "
                "(pip install sglang-router==0.3.2)"
            }
        else:
            row = run_http_system(run, args, reqs)
        row = {**base, **row}
        rows.append(row)
        if "error" in row:
            print(f"    {row['error']}", flush=True)
        else:
            print(
                f"    {row['output_tok_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                f"{row['completed']} ok / {row['failed']} failed, CPU {row.get('cpu_s')} s"
                + (f", started in {row['startup_s']} s" if "startup_s" in row else ""),
                flush=True,
            )
    same_as_offline(rows)
    header["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    json_path, png_path = write_results(args.out_dir, stem, header, rows)
    print()
    print(markdown(rows))
    print(f"\nload average at start {header['loadavg_start']}, at end {header['loadavg_end']}")
    print(f"wrote {json_path} and {png_path}")
    return 0 if all("error" not in r or r["error"].startswith("skipped") for r in rows) else 1
