"""Serving-path benchmark: one engine offline, behind a bare server, and behind Ray Serve.

    python -m bench.serve_path                                # every engine, system, concurrency
    python -m bench.serve_path --engines sim --systems bare,served1 --concurrency 256
    python -m bench.serve_path --quick --out-dir /tmp/sp      # smoke: c=8, 16 requests, 16 tokens

What it measures: what the serving path around one engine costs, in throughput and in CPU.
Every system serves the same engine on the same requests, so the differences between rows are
the path's: the bare server's HTTP and SSE, then Serve's proxy, ingress and replica hops.

Engines (both on one 2-layer random-weight Llama, ``worker.testing.make_tiny_model(folder,
"llama", num_layers=2)``: hidden size 64, make_tiny_model's only width, and SmolLM2's
tokenizer; written to a temporary folder and removed at the end):

- ``tiny``: the model itself, one torch thread (``--num-threads 1``), ``max_num_seqs`` 64.
- ``sim``: ``--engine sim --sim-profile gpu`` on that folder (its tokenizer and vocabulary
  only): the real engine with the forward pass replaced by the timing model of an 8B model
  on an H100 (a ~13 ms decode step at 256 sequences, ~20k tokens/s offered), ``max_num_seqs``
  256. Its forward pass is a wait, so its engine CPU is the engine's host work alone.

Systems, per (engine, concurrency c):

- ``offline``: ``worker.engine.LLMEngine`` stepped in this process, every request added up
  front, ``max_num_seqs`` = min(c, the engine's above), the servers' engine settings otherwise
  (so the row is the ceiling of the servers' own engine, not of a wider batch): output tok/s
  and the process's CPU only (no TTFT: nothing streams).
- ``bare``: ``python -m bench.bare_server`` (FastAPI + uvicorn around the same ``AsyncEngine``,
  one process plus its engine process): the floor of any HTTP path.
- ``served1``: ``python -m cluster.cli serve --num-replicas 1 --num-ingress-replicas 1
  --num-threads 1`` (default routing, a local Ray of its own).
- ``served2``: the same with ``--num-replicas 2 --num-ingress-replicas 2`` (two engines: at
  c > 256 it holds twice the running sequences of the others).
- ``direct1``, ``direct2``: ``served1``, ``served2`` with ``--direct-ingress``, loaded through
  the ingress replicas' own ports (printed by ``prefixserve serve``; requests spread over them
  in turn), not through Serve's proxy.
- ``served1-ray``, ``direct1-ray``: ``served1``, ``direct1`` with ``--handle-transport ray``
  (the ingress calls its replica, and Serve's proxy its ingress, by Ray actor calls instead
  of the default gRPC); only when named in ``--systems``.

Every server gets ``--max-num-seqs`` as above, ``--num-kv-blocks`` for twice the running
sequences' prompt and output, and ``--max-ongoing-requests``/``--max-queued-requests``/
``--max-waiting-requests`` above the largest concurrency, so nothing is refused with 429. A
server starts fresh per (engine, system), is reused for that pair's concurrencies (a Ray
cluster takes ~20 s to start; only one runs at a time) and is warmed up by a burst of short
requests (retried while it answers 429/503 or fails) before the first measured run. The
served systems get ``--stream-interval`` as given (default 1: a message per token; the bare
server streams every token) and, with ``--engine-cpu-affinity``, that flag (their engine
processes on CPUs of their own; the bare server's engine is never pinned).

Workload: ``--requests-per-concurrency`` x c requests per run (default 2 x c), c in flight
(a semaphore), each a fresh seeded random prompt of ``--prompt-tokens`` token ids (the same
prompts for every system at one c; other prompts at other c and for the warm-up, so no run
hits a cached prefix), ``/v1/completions`` streaming, ``max_tokens`` = ``--output-tokens``,
``ignore_eos``, temperature 0, ``stream_options.include_usage``; the client is
``bench.loadgen.client.send_request``, in this process.

Per run: output tok/s (usage's completion tokens over the wall time from first send to last
finish), TTFT p50/p99 (send to first text chunk), ITL p50/p99 (gaps between text chunks),
failed requests, and CPU seconds per 1,000 streamed output tokens by kind of process
(``cpu_s_per_1k_tokens``, from ``Server.cpu_by_process`` before and after the run; raw
labels in ``cpu_s_by_process``): ``engine`` (``python -m worker.engine_process``; offline:
this process), ``server`` (the bare server's own process), ``proxy`` (``ray::ProxyActor``),
``ingress`` (``ray::ServeReplica:*:Ingress``), ``replica`` (``ray::ServeReplica:*:
EngineReplica``), ``ray`` (everything else of a served cluster: the ``prefixserve serve``
driver, gcs_server, raylet, ServeController, MetricsHub, IndexActor, agents) and ``client``
(this process, ``getrusage``). ``outside_engine_ms_per_token`` is every server process but the
engine, in CPU-ms per streamed token (1 CPU-s per 1k tokens = 1 ms per token; null offline).

Output: ``<out-dir>/serve_path_<UTC date>[_quick].json`` (header: benchmark, date, command,
CPU model, machine, git commit, load averages; one row per run), the markdown table (printed
and ``.md``) and ``.png`` (per engine: output tok/s by concurrency per system, and CPU-ms per
token outside the engine). Progress goes to stderr, one line per run.

Failure modes: bad flags exit with argparse's usage error (2). A server that exits, is not
ready within ``--startup-timeout-s`` or fails its warm-up is stopped and gives each of its
runs a row with an ``error``; a run that raises gets one too; failed requests are counted in
their row; the other runs go on, and the exit status is 1 when any row has an error. Every
server is stopped on the way out (``Server.stop``: SIGINT, then SIGTERM and SIGKILL to its
process group and known descendants), also on errors, Ctrl-C (results so far are still
written; exit 130) and SIGTERM. Server logs go to ``--log-dir``. The client shares the cores
with the servers; on a small machine every number is that machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.cluster_process import ROUTERS_SETTLE_S
from bench.common import free_port, percentile, retry_until_served, sigterm_unwinds
from bench.result_files import RESULTS, result_header
from bench.serve.http_load import _cpu_used, _model_name, record_of
from bench.serve.processes import Server, server_env
from bench.serve.stats import summarize
from bench.serve.systems import replicas_in_metrics
from bench.serve_path_report import (
    DEFAULT_SYSTEMS,
    RAY_TRANSPORT,
    SYSTEMS,
    markdown,
    write_results,
)

ENGINES = ("tiny", "sim")
MAX_NUM_SEQS = {"tiny": 64, "sim": 256}
BLOCK_SIZE = 16  # the engine's default
WARMUP_TOKENS = 8


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.serve_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--engines", default="tiny,sim", help="subset of tiny,sim (default both)")
    ap.add_argument("--concurrency", default=None, help="default 64,256,1024 (--quick: 8)")
    ap.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help="subset of " + ",".join(SYSTEMS)
    )
    ap.add_argument("--requests-per-concurrency", type=int, default=2, help="runs send K x c")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=None, help="default 128 (--quick: 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke: c=8, 16 requests, 16 tokens")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--log-dir", type=Path, default=None, help="default $TMPDIR/serve_path_logs")
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the served systems' --stream-interval (tokens per message from a replica; the "
        "bare server streams every token)",
    )
    ap.add_argument(
        "--engine-cpu-affinity",
        action="store_true",
        help="pass --engine-cpu-affinity to the served systems (engine processes on CPUs of "
        "their own)",
    )
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    return ap


def _names(ap, flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    names = [s.strip() for s in value.split(",") if s.strip()]
    bad = [s for s in names if s not in allowed]
    if bad or not names:
        ap.error(f"{flag}: unknown {bad}; choose from {','.join(allowed)}")
    return names


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.concurrency is None:  # --quick changes defaults only; flags given explicitly win
        args.concurrency = "8" if args.quick else "64,256,1024"
    if args.output_tokens is None:
        args.output_tokens = 16 if args.quick else 128
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency: comma-separated integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency: at least one value, each >= 1")
    if min(args.requests_per_concurrency, args.prompt_tokens, args.output_tokens) < 1:
        ap.error("--requests-per-concurrency, --prompt-tokens and --output-tokens must be >= 1")
    if args.stream_interval < 1:
        ap.error("--stream-interval must be >= 1")
    args.engines = _names(ap, "--engines", args.engines, ENGINES)
    args.systems = _names(ap, "--systems", args.systems, SYSTEMS)
    return args


# -- what runs -------------------------------------------------------------------------------
def engine_flags(engine: str) -> list[str]:
    return ["--engine", "sim", "--sim-profile", "gpu"] if engine == "sim" else []


def kv_blocks(max_num_seqs: int, args) -> int:
    """Twice what ``max_num_seqs`` running sequences hold: no preemption, room for the cache."""
    per_seq = math.ceil((args.prompt_tokens + args.output_tokens + 1) / BLOCK_SIZE)
    return max(256, 2 * max_num_seqs * per_seq)


def queue_limit(args) -> int:
    """Above the largest concurrency: no server refuses a request of the closed loop."""
    return 2 * max(args.concurrency) + 64


def warm_up_size(args) -> int:
    """Requests in the warm-up burst before a system's first measured run."""
    return min(64, max(args.concurrency))


def make_prompts(n: int, args, vocab_size: int, salt: int) -> list[list[int]]:
    rng = random.Random(args.seed * 1_000_003 + salt)
    return [[rng.randrange(100, vocab_size) for _ in range(args.prompt_tokens)] for _ in range(n)]


def cpu_kind(label: str) -> str:
    """Which kind of process a ``bench.serve.processes.process_label`` names (module docstring)."""
    if label.startswith("ray::ProxyActor"):
        return "proxy"
    if label.startswith("ray::ServeReplica:") and label.endswith(":Ingress"):
        return "ingress"
    if label.startswith("ray::ServeReplica:") and label.endswith(":EngineReplica"):
        return "replica"
    if label == "python -m worker.engine_process":
        return "engine"
    if label == "python -m bench.bare_server":
        return "server"
    return "ray"


def cpu_fields(by_kind: dict[str, float], tokens: int) -> dict:
    """The row's CPU fields from CPU seconds by kind (``client`` included) and streamed tokens."""
    per_1k = {k: round(1000 * v / tokens, 3) for k, v in by_kind.items()} if tokens else {}
    outside = sum(v for k, v in by_kind.items() if k not in ("engine", "client"))
    return {
        "cpu_s_by_kind": {k: round(v, 2) for k, v in by_kind.items()},
        "cpu_s_per_1k_tokens": per_1k,
        "outside_engine_ms_per_token": round(1000 * outside / tokens, 3) if tokens else None,
    }


def _rusage_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- offline ---------------------------------------------------------------------------------
def run_offline(engine: str, model: str, prompts: list[list[int]], c: int, args) -> dict:
    """``LLMEngine`` in this process, every request added up front; see the module docstring."""
    from worker import EngineConfig, LLMEngine, SamplingParams

    seqs = min(c, MAX_NUM_SEQS[engine])
    config = EngineConfig(
        model=model,
        engine="sim" if engine == "sim" else "model",
        sim_profile="gpu",
        max_num_seqs=seqs,
        num_threads=1,
        num_kv_blocks=kv_blocks(seqs, args),
        max_waiting_requests=len(prompts) + 1,
    )
    llm = LLMEngine(config)
    warm = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    for i, ids in enumerate(make_prompts(warm_up_size(args), args, _vocab_size(model), -2)):
        llm.add_request(f"warm-up-{i}", ids, warm)  # the servers' warm-up burst
    while llm.has_unfinished():
        llm.step()
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    cpu0, t0 = _rusage_s(), time.perf_counter()
    for i, ids in enumerate(prompts):
        llm.add_request(f"r{i}", ids, params)
    tokens = failed = 0
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                tokens += len(out.token_ids)
                failed += out.error is not None
    duration, cpu = time.perf_counter() - t0, _rusage_s() - cpu0
    del llm
    return {
        "max_num_seqs": seqs,
        "completed": len(prompts) - failed,
        "failed": failed,
        "duration_s": round(duration, 3),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / duration, 1),
        **cpu_fields({"engine": cpu}, tokens),
        "outside_engine_ms_per_token": None,  # no server
    }


# -- servers ---------------------------------------------------------------------------------
def server_argv(engine: str, system: str, model: str, port: int, args) -> list[str]:
    seqs, limit = MAX_NUM_SEQS[engine], str(queue_limit(args))
    common = [
        "--model", model, "--port", str(port), "--num-threads", "1",
        "--max-num-seqs", str(seqs), "--num-kv-blocks", str(kv_blocks(seqs, args)),
        "--max-waiting-requests", limit, *engine_flags(engine),
    ]  # fmt: skip
    if system == "bare":
        return [sys.executable, "-m", "bench.bare_server", *common]
    n = str(num_replicas(system))
    return [
        sys.executable, "-m", "cluster.cli", "serve", *common,
        "--num-replicas", n, "--num-ingress-replicas", n,
        "--max-ongoing-requests", str(max(*args.concurrency, seqs)), "--max-queued-requests", limit,
        *(["--direct-ingress"] if system.startswith("direct") else []),
        *(["--handle-transport", "ray"] if system.endswith(RAY_TRANSPORT) else []),
        "--stream-interval", str(args.stream_interval),
        *(["--engine-cpu-affinity"] if args.engine_cpu_affinity else []),
    ]  # fmt: skip


def num_replicas(system: str) -> int:
    return 2 if system.removesuffix(RAY_TRANSPORT).endswith("2") else 1


DIRECT_LINE = re.compile(r"prefixserve: direct ingress at (http://\S+)/v1")


def direct_urls(srv: Server, n: int, timeout_s: float = 90.0) -> list[str]:
    """The ``n`` ingress replicas' own URLs, as ``prefixserve serve --direct-ingress`` prints
    them into its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        urls = DIRECT_LINE.findall(srv.log_path.read_text(errors="replace"))
        if len(urls) >= n:
            return urls[:n]
        time.sleep(1.0)
    raise RuntimeError(f"{srv.name}: no {n} direct ingress URLs in {srv.log_path}")


def start_server(engine: str, system: str, model: str, args) -> tuple[Server, list[str], str]:
    """Starts, waits for and warms up one server: (it, the base URLs to load, the model id it
    serves); on failure it is stopped and the error raised."""
    port = free_port()
    argv = server_argv(engine, system, model, port, args)
    log = args.log_dir / f"{engine}_{system}.log"
    srv = Server(f"{engine} {system}", argv, log, server_env(1))
    base = f"http://127.0.0.1:{port}"
    replicas = num_replicas(system)
    try:
        srv.wait_ready(
            base + "/health",
            args.startup_timeout_s,
            ready=(lambda: replicas_in_metrics(base) >= replicas) if replicas > 1 else None,
        )
        bases = [base]
        if system != "bare":
            time.sleep(ROUTERS_SETTLE_S)
        if system.startswith("direct"):
            bases = direct_urls(srv, replicas)
        model_id = _model_name(base) or Path(model).name
        warm_up(bases, model_id, _vocab_size(model), args)
    except BaseException:
        srv.stop()
        raise
    return srv, bases, model_id


def warm_up(
    bases: list[str], model_id: str, vocab_size: int, args, patience_s: float = 120.0
) -> None:
    """A burst of short requests until one goes through without a failure; raises after
    ``patience_s`` (a server may answer /health before it can route)."""
    n = warm_up_size(args)
    prompts = make_prompts(n, args, vocab_size, -2)
    retry_until_served(
        lambda: asyncio.run(_load(bases, model_id, prompts, n, WARMUP_TOKENS, 120.0))[0],
        patience_s,
    )


async def _load(
    bases: list[str],
    model_id: str,
    prompts: list[list[int]],
    c: int,
    max_tokens: int,
    timeout_s: float,
) -> tuple[list[dict], float]:
    """Every prompt as a streaming completion, ``c`` in flight, request i to ``bases[i %
    len(bases)]``; per-request records."""
    import httpx

    from bench.loadgen.client import RequestOutput, RequestSettings, request_body, send_request

    doors = [
        RequestSettings(base_url=base, model=model_id, ignore_eos=True, timeout_s=timeout_s)
        for base in bases
    ]
    limiter = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=c + 8, max_keepalive_connections=c + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int, ids: list[int]) -> dict:
            door = doors[i % len(doors)]
            out = RequestOutput(i, 0)
            async with limiter:
                await send_request(
                    client, door, request_body(door, max_tokens, prompt=ids), out, t0
                )
            return record_of(out)

        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - t0
    return list(records), duration


def run_served(
    srv: Server, bases: list[str], model_id: str, prompts: list[list[int]], c, args
) -> dict:
    """One measured run against a started server: latency, throughput, CPU by kind."""
    if srv.proc.poll() is not None:
        raise RuntimeError(f"{srv.name} exited with status {srv.proc.returncode} ({srv.log_path})")
    before, client0 = srv.cpu_by_process(), _rusage_s()
    records, duration = asyncio.run(
        _load(bases, model_id, prompts, c, args.output_tokens, args.request_timeout_s)
    )
    client, after = _rusage_s() - client0, srv.cpu_by_process()
    row = summarize(records, duration)
    row.pop("text_digests")
    ok = [r for r in records if r["success"]]
    itls = [g for r in ok for g in r["itl_s"]]
    row["itl_p50_ms"] = round(1000 * percentile(itls, 50), 2)
    row["itl_p99_ms"] = round(1000 * percentile(itls, 99), 2)
    used = _cpu_used([before], [after])
    by_kind: dict[str, float] = {}
    for label, seconds in used:
        by_kind[cpu_kind(label)] = by_kind.get(cpu_kind(label), 0.0) + seconds
    by_kind["client"] = client
    row.update(cpu_fields(by_kind, row["output_tokens"]))
    row["cpu_s_by_process"] = {label: round(seconds, 3) for label, seconds in used}
    return row


def _vocab_size(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_all(args, model: str, rows: list[dict]) -> None:
    """Every (engine, system, concurrency) into ``rows``, as it finishes."""
    vocab = _vocab_size(model)
    prompts = {
        c: make_prompts(args.requests_per_concurrency * c, args, vocab, c) for c in args.concurrency
    }
    total = len(args.engines) * len(args.systems) * len(args.concurrency)
    for engine in args.engines:
        for system in args.systems:
            srv = bases = model_id = None
            start_error = None
            if system != "offline":
                _progress(f"{engine} {system}: starting")
                t0 = time.monotonic()
                try:
                    srv, bases, model_id = start_server(engine, system, model, args)
                    _progress(f"{engine} {system}: ready in {time.monotonic() - t0:.0f} s")
                except Exception as exc:  # its runs get the error, the others still run
                    start_error = f"{type(exc).__name__}: {exc}"
            try:
                for c in args.concurrency:
                    row = {
                        "engine": engine,
                        "system": system,
                        "concurrency": c,
                        "num_requests": len(prompts[c]),
                        "max_num_seqs": MAX_NUM_SEQS[engine],
                        "replicas": num_replicas(system),
                    }
                    _progress(f"[{len(rows) + 1}/{total}] {engine} {system} c={c}")
                    try:
                        if start_error:
                            raise RuntimeError(start_error)
                        if system == "offline":
                            row.update(run_offline(engine, model, prompts[c], c, args))
                        else:
                            row["command"] = srv.command
                            row.update(run_served(srv, bases, model_id, prompts[c], c, args))
                    except Exception as exc:
                        row["error"] = str(exc) if start_error else f"{type(exc).__name__}: {exc}"
                    rows.append(row)
                    _progress(
                        f"    error: {row['error']}"
                        if "error" in row
                        else f"    {row['output_tok_per_s']:.0f} tok/s, {row['failed']} failed, "
                        f"outside engine {row.get('outside_engine_ms_per_token')} CPU-ms/token"
                    )
            finally:
                if srv is not None:
                    srv.stop()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    now = datetime.now(timezone.utc)
    stem = f"serve_path_{now.strftime('%Y-%m-%d')}" + ("_quick" if args.quick else "")
    args.log_dir = args.log_dir or Path(tempfile.gettempdir()) / f"{stem}_logs"
    args.log_dir.mkdir(parents=True, exist_ok=True)
    header = {
        **result_header("serve_path", "bench.serve_path", argv, "cpu"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "title": f"{args.prompt_tokens}-token prompts, {args.output_tokens} streamed tokens, "
        f"{args.requests_per_concurrency} x c requests",
        "workload": {
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "requests_per_concurrency": args.requests_per_concurrency,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "ignore_eos": True,
            "temperature": 0,
            "stream_interval": args.stream_interval,
            "engine_cpu_affinity": args.engine_cpu_affinity,
        },
        "engines": {
            e: {
                "model": "make_tiny_model llama, 2 layers, hidden 64",
                "flags": engine_flags(e) + ["--num-threads", "1"],
                "max_num_seqs": MAX_NUM_SEQS[e],
                "num_kv_blocks": kv_blocks(MAX_NUM_SEQS[e], args),
            }
            for e in args.engines
        },
        "queue_limits": queue_limit(args),
        "log_dir": str(args.log_dir),
    }
    rows: list[dict] = []
    interrupted = False
    try:
        with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="serve_path_model_") as tmp:
            from worker.testing import make_tiny_model

            model = make_tiny_model(Path(tmp) / "tiny-llama", "llama", num_layers=2)
            run_all(args, model, rows)
    except KeyboardInterrupt:
        interrupted = True
        _progress("interrupted: every server stopped; writing the rows so far")
    header["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    header["interrupted"] = interrupted
    paths = write_results(args.out_dir, stem, header, rows)
    print(markdown(rows))
    print(f"\nload average at start {header['loadavg_start']}, at end {header['loadavg_end']}")
    print("wrote " + ", ".join(str(p) for p in paths))
    if interrupted:
        return 130
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
