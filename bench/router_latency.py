"""Routing decision latency and throughput of one router process, embedded vs Redis index.

A decision here is everything the router does per request: hash the prompt's blocks
(``router.protocol.hash_blocks``), one index lookup, the ``prefix`` policy, and handing the
speculative entry of the chosen replica to the router's writer thread (``routing.Router``).
Reports per prompt size (1k and 8k tokens): wall-clock p50/p99, decisions per second for one
sequential router, the deciding thread's CPU time per decision (p50/p99), the server-side
time of the Redis lookup script (commandstats) and CPU per decision of both processes, into
``bench/results/router_latency.json`` and a PNG beside it.

The index is filled the way a fleet fills it: ``--num-replicas`` replicas, each holding
its share of ``--num-prefixes`` shared prefixes (75% of the prompt) plus background blocks,
all through KV event batches. Requests reuse a random prefix plus a fresh suffix; replica
loads drift as bounded random walks; replicas heartbeat every second (untimed). Without
``--redis-url`` a throwaway ``redis-server`` is started on a free loopback port; without the
binary the Redis rows are skipped (and say so). Wall-clock tails depend on the machine's
load (the JSON records the load average); CPU and server-side times much less so: on an idle
machine a decision takes about thread CPU + lookup script time + one loopback round trip.

    python -m bench.router_latency [--redis-url redis://127.0.0.1:6379/0] [--num-decisions 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

from bench.common import free_port
from router.config import RouterConfig
from router.index import make_index
from router.load import replica_load
from router.policy import ReplicaView
from router.protocol import EventKind, KVEvent, KVEventBatch, ReplicaStats, hash_blocks
from router.routing import Router

MODEL_ID = "bench-model"
PROMPT_SIZES = (1024, 8192)
SHARED_FRACTION = 0.75  # of each prompt: a system prompt / document reused across requests
VOCAB_SIZE = 50_000
TARGET_P99_MS = 2.0  # the budget per decision, hashing included
# Replicas heartbeat this often (untimed); the index declares them dead after 10 s.
HEARTBEAT_INTERVAL_S = 1.0
# Lookups replayed alone after the timed loop to read the server's own time per lookup.
NUM_REPLAYED_LOOKUPS = 300
MAX_QUEUED_TOKENS = 8192  # a replica's prefill backlog: up to ~1 s at 8000 tokens/s
QUEUE_STEP_TOKENS = 256  # how far a backlog moves between two decisions
RESULTS_DIR = Path(__file__).parent / "results"


def _start_redis() -> tuple[subprocess.Popen, str, str]:
    workdir = tempfile.mkdtemp(prefix="router-bench-redis-")
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    process = subprocess.Popen(
        [*cmd, "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    client.close()
    return process, url, workdir


def _populate(router: Router, rng: random.Random, args, prefixes: dict[int, list]) -> None:
    replica_ids = [f"replica-{i}" for i in range(args.num_replicas)]
    for rid in replica_ids:
        router.index.heartbeat(rid, 0)
    batches = []
    seq = dict.fromkeys(replica_ids, 0)
    for token_lists in prefixes.values():
        for tokens in token_lists:
            blocks = hash_blocks(tokens, router.config.block_size, MODEL_ID)
            for rid in rng.sample(replica_ids, rng.choice((1, 2))):
                event = KVEvent(EventKind.STORED, tuple(blocks))
                batches.append(KVEventBatch(rid, seq[rid], (event,)))
                seq[rid] += 1
    for rid in replica_ids:  # unrelated blocks, so sets have a realistic size
        noise = tuple(rng.randbytes(16) for _ in range(args.background_blocks))
        batches.append(KVEventBatch(rid, seq[rid], (KVEvent(EventKind.STORED, noise),)))
        seq[rid] += 1
    for start in range(0, len(batches), 64):
        router.index.apply_many(batches[start : start + 64])


def _view_stream(rng: random.Random, num_replicas: int, num_views: int) -> list[list[ReplicaView]]:
    """Replica loads that drift (a bounded random walk per replica) rather than jump: load
    drawn afresh per request would scatter every prefix over every replica, which no real
    fleet's stats do between two reports."""
    queued = [rng.randrange(MAX_QUEUED_TOKENS) for _ in range(num_replicas)]
    views = []
    for _ in range(num_views):
        queued = [
            min(MAX_QUEUED_TOKENS, max(0, q + rng.randrange(-QUEUE_STEP_TOKENS, QUEUE_STEP_TOKENS)))
            for q in queued
        ]
        stats = [
            ReplicaStats(
                num_waiting=q // 2048,
                num_running=16,
                num_queued_prefill_tokens=q,
                prefill_tokens_per_s=8000.0,
            )
            for q in queued
        ]
        views.append([ReplicaView(f"replica-{i}", s, replica_load(s)) for i, s in enumerate(stats)])
    return views


def _redis_cpu_s(redis_url: str | None) -> float:
    """CPU seconds the Redis server has used (user + sys); 0 without Redis."""
    if redis_url is None:
        return 0.0
    client = redis.Redis.from_url(redis_url)
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _server_us_per_lookup(redis_url: str | None, router: Router, lookups: list) -> float | None:
    """Mean server-side microseconds of the lookup script (Redis commandstats, inner commands
    included), replaying lookups alone so no other script is counted."""
    if redis_url is None:
        return None
    client = redis.Redis.from_url(redis_url)
    try:
        client.config_resetstat()
        for block_hashes in lookups:
            router.index.inner.match(block_hashes)
        stats = client.info("commandstats")["cmdstat_evalsha"]
    finally:
        client.close()
    return float(stats["usec"]) / float(stats["calls"])


def _measure(router: Router, rng, args, prefixes, prompt_tokens: int, redis_url) -> dict:
    shared = prefixes[prompt_tokens]
    num_suffix = prompt_tokens - len(shared[0])
    hash_ms, route_ms, cpu_ms, num_matched = [], [], [], 0
    fallbacks_before = router.metrics.snapshot()["num_fallback_decisions"]
    # Requests are drawn up front so that the timed loop and its CPU time hold router work only.
    num_requests = args.warmup + args.num_decisions
    token_lists = [
        rng.choice(shared) + [rng.randrange(VOCAB_SIZE) for _ in range(num_suffix)]
        for _ in range(num_requests)
    ]
    requests = list(
        zip(token_lists, _view_stream(rng, args.num_replicas, num_requests), strict=True)
    )
    last_heartbeat_s = 0.0
    for i, (tokens, views) in enumerate(requests):
        if time.monotonic() - last_heartbeat_s > HEARTBEAT_INTERVAL_S:  # as live replicas do
            for view in views:
                router.index.heartbeat(view.replica_id, 0)
            last_heartbeat_s = time.monotonic()
        if i == args.warmup:
            router.flush()
            total_start = time.perf_counter()
            cpu_start_s = time.process_time()
            redis_cpu_start_s = _redis_cpu_s(redis_url)
        c0 = time.thread_time()
        t0 = time.perf_counter()
        blocks = hash_blocks(tokens, router.config.block_size, MODEL_ID)
        t1 = time.perf_counter()
        decision = router.route(blocks, len(tokens), views)
        t2 = time.perf_counter()
        c1 = time.thread_time()
        if i >= args.warmup:
            cpu_ms.append((c1 - c0) * 1e3)
            hash_ms.append((t1 - t0) * 1e3)
            route_ms.append((t2 - t1) * 1e3)
            num_matched += decision.matched_blocks
    router.flush()
    router_cpu_s = time.process_time() - cpu_start_s
    redis_cpu_s = _redis_cpu_s(redis_url) - redis_cpu_start_s
    replayed = [
        hash_blocks(tokens, router.config.block_size, MODEL_ID)
        for tokens, _ in requests[-NUM_REPLAYED_LOOKUPS:]
    ]
    server_us = _server_us_per_lookup(redis_url, router, replayed)
    decision_s = float(np.sum(hash_ms) + np.sum(route_ms)) / 1e3
    total = np.array(hash_ms) + np.array(route_ms)
    return {
        "prompt_tokens": prompt_tokens,
        "num_decisions": args.num_decisions,
        "p50_ms": float(np.percentile(total, 50)),
        "p99_ms": float(np.percentile(total, 99)),
        "mean_ms": float(total.mean()),
        "hash_p50_ms": float(np.percentile(hash_ms, 50)),
        "hash_p99_ms": float(np.percentile(hash_ms, 99)),
        "route_p50_ms": float(np.percentile(route_ms, 50)),
        "route_p99_ms": float(np.percentile(route_ms, 99)),
        # One thread deciding back to back: 1 / mean decision latency.
        "decisions_per_s": args.num_decisions / decision_s,
        # CPU time of the deciding thread per decision (hashing included): what a decision
        # costs the router without waiting for a CPU or for Redis.
        "thread_cpu_p50_ms": float(np.percentile(cpu_ms, 50)),
        "thread_cpu_p99_ms": float(np.percentile(cpu_ms, 99)),
        # Server-side execution time of one lookup script (commandstats mean, replayed).
        "redis_lookup_server_mean_us": server_us,
        "matched_block_ratio": num_matched / (args.num_decisions * (prompt_tokens // 16)),
        "loop_wall_s": time.perf_counter() - total_start,
        # CPU time per decision does not depend on what else the machine runs: on an idle
        # machine a decision takes about router CPU + Redis CPU + one loopback round trip.
        "router_cpu_ms_per_decision": router_cpu_s * 1e3 / args.num_decisions,
        "redis_cpu_ms_per_decision": redis_cpu_s * 1e3 / args.num_decisions,
        # Decisions made without the index (it timed out): they are faster and not what
        # this bench measures, so a row with any is not a valid measurement.
        "num_fallback_decisions": router.metrics.snapshot()["num_fallback_decisions"]
        - fallbacks_before,
    }


def run_backend(backend: str, redis_url: str | None, args) -> list[dict]:
    rng = random.Random(args.seed)
    config = RouterConfig(
        index_backend=backend,
        redis_url=redis_url,
        redis_socket_timeout_s=args.redis_socket_timeout_s,
    )
    index = make_index(config, f"{MODEL_ID}-{os.getpid()}-{backend}")
    router = Router(config, MODEL_ID, index=index)
    prefixes = {
        size: [
            [rng.randrange(VOCAB_SIZE) for _ in range(int(size * SHARED_FRACTION))]
            for _ in range(args.num_prefixes)
        ]
        for size in PROMPT_SIZES
    }
    _populate(router, rng, args, prefixes)
    rows = []
    for size in PROMPT_SIZES:
        row = {"backend": backend, **_measure(router, rng, args, prefixes, size, redis_url)}
        print(
            f"{backend:9s} {size:5d} tokens: p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f}"
            f" ms  (hash p50 {row['hash_p50_ms']:.3f}, route p50 {row['route_p50_ms']:.3f})"
            f"  {row['decisions_per_s']:.0f} decisions/s, {row['num_fallback_decisions']} fallbacks"
            f", matched {row['matched_block_ratio']:.2f}"
            f"; CPU/decision: router {row['router_cpu_ms_per_decision']:.3f} ms,"
            f" redis {row['redis_cpu_ms_per_decision']:.3f} ms; thread CPU p50/p99"
            f" {row['thread_cpu_p50_ms']:.3f}/{row['thread_cpu_p99_ms']:.3f} ms;"
            f" lookup script {row['redis_lookup_server_mean_us']} us"
        )
        rows.append(row)
    for rid in router.index.replicas():
        router.index.remove_replica(rid)
    router.close()
    return rows


def plot(rows: list[dict], path: Path, loadavg_1m: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['backend']}\n{r['prompt_tokens']} tok" for r in rows]
    x = np.arange(len(rows))
    width = 0.27
    fig, ax = plt.subplots(figsize=(8, 4.5))
    hash_p50 = [r["hash_p50_ms"] for r in rows]
    ax.bar(x - width, hash_p50, width, label="p50 wall: hashing")
    ax.bar(
        x - width,
        [r["p50_ms"] - h for r, h in zip(rows, hash_p50, strict=True)],
        width,
        bottom=hash_p50,
        label="p50 wall: lookup + policy",
    )
    ax.bar(x, [r["thread_cpu_p99_ms"] for r in rows], width, label="p99 CPU of the deciding thread")
    ax.bar(x + width, [r["p99_ms"] for r in rows], width, label="p99 wall (shared machine)")
    ax.set_yscale("log")
    ax.set_ylim(0.05, 10 * max(r["p99_ms"] for r in rows))
    ax.axhline(TARGET_P99_MS, color="red", linestyle="--", label="p99 target")
    ax.set_xticks(x, labels)
    ax.set_ylabel("decision latency (ms)")
    ax.set_title(f"Routing decision latency, one router process (load avg {loadavg_1m:.1f})")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--num-replicas", type=int, default=8)
    parser.add_argument("--num-prefixes", type=int, default=64)
    parser.add_argument("--background-blocks", type=int, default=20_000)
    parser.add_argument("--num-decisions", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    # Longer than the serving default (0.05 s): this measures lookups, including slow ones,
    # instead of letting a loaded machine turn them into load-only fallback decisions.
    parser.add_argument("--redis-socket-timeout-s", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "router_latency.json")
    args = parser.parse_args()
    loadavg_start = os.getloadavg()[0]

    rows = run_backend("embedded", None, args)
    server, redis_note = None, "external"
    redis_url = args.redis_url
    if redis_url is None and shutil.which("redis-server"):
        server, redis_url, workdir = _start_redis()
        redis_note = "throwaway redis-server on loopback"
    try:
        if redis_url is not None:
            rows += run_backend("redis", redis_url, args)
            client = redis.Redis.from_url(redis_url)
            redis_note += f", version {client.info()['redis_version']}"
            client.close()
        else:
            redis_note = "skipped: no redis-server binary and no --redis-url"
    finally:
        if server is not None:
            server.kill()
            server.wait()
            shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "bench": "router_latency",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_1m_at_start": loadavg_start,
            "loadavg_1m": os.getloadavg()[0],
        },
        "redis": redis_note,
        "args": {k: str(v) for k, v in vars(args).items()},
        "target_p99_ms": TARGET_P99_MS,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"), result["machine"]["loadavg_1m"])
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
