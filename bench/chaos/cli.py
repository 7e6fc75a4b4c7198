"""``python -m bench.chaos``: the chaos benchmark's servers, flags and result files.

``main`` starts one ``prefixserve serve`` (2 engine replicas, 2 ingress replicas, the bundled
model; with ``--redis`` a redis-server behind a ``SlowProxy``), runs the fault-free load and
then each fault (``run_server``), then a second server at ``--tensor-parallel-size TP_SIZE`` for
the TP faults; it writes ``bench/results/chaos_<date>.{json,md}`` and prints the table.

How it fails: unknown fault names (or Redis faults without ``--redis``) are a usage error
(exit 2); a server that does not start raises (its log is in the temporary folder printed at
the start); each server and redis-server is stopped however the runs end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.chaos.faults import (
    FAULTS,
    REDIS_FAULTS,
    REDIS_SLOW_DELAY_S,
    TP_FAULTS,
    RedisSide,
    SlowProxy,
    start_redis,
)
from bench.chaos.load import MAX_TOKENS, NUM_KV_BLOCKS, Load, Target
from bench.chaos.report import FaultResult, markdown
from bench.chaos.run import probe_ok, run_baseline, run_fault
from bench.common import free_port
from bench.result_files import RESULTS, result_header
from bench.serve.processes import Server, server_env

DESCRIPTION = (
    "Chaos benchmark: faults injected under a steady load of streaming requests, with figures."
)
TP_SIZE = 3
"""Tensor-parallel ranks per replica on the server that runs ``TP_FAULTS``."""


def run_server(
    faults: list[str],
    args,
    prompts: list[list[dict]],
    workdir: Path,
    *,
    tp: int = 1,
    serve_args: tuple[str, ...] = (),
    redis: RedisSide | None = None,
) -> list[FaultResult]:
    """One ``prefixserve serve`` (``tp`` ranks per replica): a fault-free run, then
    ``faults`` one after another."""
    port = free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--num-replicas", "2"]
    argv += ["--num-threads", "1", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--port", str(port)]
    argv += ["--tensor-parallel-size", str(tp), *serve_args]
    log = workdir / f"server_tp{tp}.log"
    server = Server("prefixserve", argv, log, env=server_env(1))
    target = Target(f"http://127.0.0.1:{port}", server.proc.pid)
    load = Load(concurrency=args.concurrency, duration_s=args.duration_s)
    probe = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 2}
    results: list[FaultResult] = []
    try:
        server.wait_ready(
            f"{target.url}/v1/models", timeout_s=600, ready=lambda: probe_ok(target, probe)
        )
        name = "none" if tp == 1 else f"none (tp {tp})"
        print(f"fault-free run ({name}) ...", file=sys.stderr, flush=True)
        row, baseline = run_baseline(target, prompts, load, name)
        results.append(row)
        for fault in faults:
            print(f"fault {fault} ...", file=sys.stderr, flush=True)
            results.append(run_fault(fault, target, prompts, load, baseline, probe, redis))
    finally:
        server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=DESCRIPTION)
    parser.add_argument(
        "--duration-s", type=float, default=60.0, help="load per fault (default 60)"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help="comma-separated (tp_worker_kill on a second server with --tensor-parallel-size "
        f"{TP_SIZE}); with --redis also {','.join(REDIS_FAULTS)}",
    )
    parser.add_argument(
        "--redis", action="store_true", help="use a redis-server index (adds two faults)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS) - (set(REDIS_FAULTS) if args.redis else set())
    if unknown:
        parser.error(
            f"unknown faults (or Redis faults without --redis): {', '.join(sorted(unknown))}"
        )
    from bench.loadgen.workloads import load_workload

    prompts = [request.messages for request in load_workload(16)]
    date = datetime.date.today().isoformat()
    out_base = args.out or RESULTS / f"chaos_{date}"
    workdir = Path(tempfile.mkdtemp(prefix="prefixserve-chaos-"))
    print(f"server logs and Redis files in {workdir}", file=sys.stderr, flush=True)
    redis, serve_args = None, ()
    if args.redis:
        redis_port = free_port()
        redis = RedisSide(
            start_redis(redis_port, workdir), SlowProxy(redis_port, REDIS_SLOW_DELAY_S), workdir
        )
        serve_args = ("--redis-url", f"redis://127.0.0.1:{redis.proxy.port}/0")
        faults += [f for f in REDIS_FAULTS if f not in faults]
    tp_faults = [f for f in faults if f in TP_FAULTS]
    results: list[FaultResult] = []
    try:
        plain = [f for f in faults if f not in TP_FAULTS]
        if plain or not tp_faults:
            results += run_server(plain, args, prompts, workdir, serve_args=serve_args, redis=redis)
        if tp_faults:
            results += run_server(
                tp_faults, args, prompts, workdir, tp=TP_SIZE, serve_args=serve_args, redis=redis
            )
    finally:
        if redis is not None:
            redis.proc.kill()
    load = f"{args.concurrency} closed-loop streams, {args.duration_s:.0f} s per fault, "
    load += f"{MAX_TOKENS} greedy tokens, 2 engine x 1 thread, 2 ingress replicas"
    if tp_faults:
        load += f" ({', '.join(tp_faults)}: engines at --tensor-parallel-size {TP_SIZE})"
    header = {
        **result_header("chaos", "bench.chaos", argv),
        "load": load,
        "loadavg_start": os.getloadavg(),
    }
    rows = [asdict(r) for r in results]
    Path(f"{out_base}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    Path(f"{out_base}.md").write_text(markdown(header, rows))
    print(markdown(header, rows))
    return 0
