"""The router at cluster scale on the real stack, beside the simulator's prediction.

    python -m bench.scale                                   # 8, 16, 32 replicas x 4 policies
    python -m bench.scale --replicas 8 --policies prefix round_robin --tag smoke
    python -m bench.scale --replicas 16 --policies prefix --index embedded redis

For each size in ``--replicas``, each index backend in ``--index`` (``embedded``; ``redis``
too when ``--redis-url`` is given or a ``redis-server`` binary is found: one throwaway
server on a free loopback port per cluster, as ``tests/router/conftest.py`` starts it), each
workload in ``--workloads`` and each policy in ``--policies`` it starts a fresh cluster,
one at a time::

    python -m cluster.cli serve --model smollm2 --engine sim --sim-profile <profile.json>
        --num-replicas N --num-ingress-replicas K --num-cpus-per-replica 0.05 --num-threads 1
        --routing P --num-kv-blocks C --speculative-ttl-s T --expose-replica-headers [--redis-url]
        [--kv-pull-tokens-per-s R]

With ``--kv-pulls`` the ``prefix`` cells run with KV pulls: the cluster prices a pull at R, the
profile's ``kv_transfer_bytes_per_s`` (slowed like every rate) over the simulator's
``PULL_PRICE_FACTOR``, its replicas wait out that transfer rate (``cluster.kv_pull.
SimulatedLink``), and the simulator pulls at the same rate; the report shows the part of the
hit rate that was pulled (``prefixserve:kv_pull_tokens_total``).

waits until ``/health`` answers and ``/metrics`` shows all N engine replicas, sends a few
one-block-short warm-up requests (nothing cacheable), measures every process's idle CPU for
``--idle-s`` seconds (psutil over the server's process tree, by kind as
``bench/serve_path.py`` names them, and per process label in the JSON), then drives the
workload and stops the cluster (SIGINT, then SIGTERM and SIGKILL to its process group:
``bench/serve/processes.py``).

Workload: the simulator's own (``bench/sim/workloads.py``, ``WorkloadScale`` with the same
size, seed, ``--capacity-blocks`` and ``--requests-per-replica``; ``generated_shared_prefix``
by default). Each block id becomes 16 token ids (``block_token_ids``): the first two spell
the id in base ``M`` (the vocabulary above ``TOKEN_LO``), so two different ids differ in
their first or second token, and the other 14 are a BLAKE2b hash of the id; a prompt is its
blocks' tokens followed by the request's own tail when its token count is not a multiple of
16. Two requests that share k leading blocks thus share k * 16 leading token ids, and the
engine's block hashes see the same prefix tree as the simulator's ids. Each request goes as
``/v1/completions`` with that token-id prompt, streaming with usage, ``max_tokens`` and
``ignore_eos`` from the workload, temperature 0, at the workload's arrival time (open loop:
a request is sent on time whatever is in flight).

Rate and time scale: the simulator defines a workload's load as its arrival rate over the
cluster's prefill capacity without cache hits, ``N * prefill_tokens_per_s / mean prompt
tokens`` (``--offered-load``, default 0.8). With the ``gpu`` profile (40k prompt tokens/s per
replica) 0.8 of that is ~220 requests/s at 8 replicas of 1152-token prompts, while on a
2-core machine the cluster's processes already take 1.0-1.4 CPU-s/s to stream ~230 tokens/s
(6 requests/s of 64 tokens) over 8-16 replicas. So the run slows the simulated GPU down
instead: ``--time-scale`` S (``auto``: the S at which the offered load is ``--rate``
requests/s, default 6) multiplies every time of the profile (prefill and host-tier rates
divided by S, decode step terms multiplied), the profile goes to the engines as a JSON file,
and the workload's arrivals are drawn at the slowed capacity. Every replica then sits at the
same ``--offered-load`` of its slowed engine, and the simulator runs the same slowed rates,
so real and simulated seconds are the same seconds; the host's fixed costs (HTTP, proxy,
ingress, routing: tens of ms) shrink relative to the engine's as S grows. ``--time-scale 1``
runs the profile as is (the host then saturates long before the engines). The load counts
no hits: with the cache hits a workload gets, the engines' prefill is busy well below the
offered load, and less so under a cache-blind policy.

Beside each real cell the simulator (``bench.sim.simulator``, in this process) runs the same
workload, size and policy (``prefix``: ``bench/sim/ours.py``, the others
``bench/sim/baselines.py``) with ``EngineRates`` from the slowed profile
(``engine_rates``). What cannot match exactly: the simulator's decode step is ``base +
per_seq * (n - 1)`` with no context term, so the profile's per-context-token seconds are
folded in at the workload's mean context (prompt plus half the output); a step computes one
prompt's chunk, where the engine may fill a step's 512 tokens from several, and the running
batch is not capped (the engine runs ``max_num_seqs`` 64); decodes take their growing blocks
lazily (at the replica's events, and on time only when the pool would run short); it runs as
many ``prefix`` routers as the cluster has ingress replicas, requests dealt to them in turn
where Serve's proxy picks by the ingress replicas' queues, and its routers see every
replica's exact state at once, the real ones the stats Serve polls each second and their own
and the board's in-flight counts; its router config takes the profile's rates as the
replicas' rates, the real routers each replica's measured ones. The speculative-entry TTL is the
simulator's (``max(5 s, 8192 tokens at the slowed prefill rate)``), given to the cluster as
``--speculative-ttl-s``. The simulator's TTFT is its prefill's end minus arrival; the real
one is the client's, send to first text.

Per cell (one row): hit rate (usage's cached prompt tokens over prompt tokens, successful
requests), TTFT p50/p90/p99, requests per replica (the ``x-prefixserve-replica`` header) and
their max/mean, failures, startup seconds (launch to serving with every replica), output
tok/s, the routers' index-lookup and whole-decision latency over the run
(``prefixserve:router_lookup_latency_seconds`` and ``router_decision_latency_seconds`` from
``/metrics``: mean, and the p50/p99 bucket bounds) and the decisions' own CPU time
(``router_decision_cpu_seconds``, the same way), the engines' preemptions over the run
(``prefixserve:num_preemptions_total``), idle CPU-s/s by kind of process and per engine
replica (its Ray actor plus its engine process), CPU-s/s by kind under load, the machine's
used memory after startup, the simulator's hit rate, TTFT p50/p90/p99, max/mean and
preemptions (and, in files written before it modelled them, its overflow blocks), and the
relative differences ``(real - sim) / sim`` of hit rate and TTFT p50/p90.

Writes ``<out-dir>/scale_<tag>.json`` (``bench/result_files.py``'s header plus the run's
settings; one row per cell), ``.md`` (the table) and ``.png`` (TTFT p90 and hit rate by size,
one colour per policy, real solid, simulated dashed), rewritten after every cell so an
interrupted run keeps its cells. Progress lines go to stderr as each cell starts and ends.

A cell takes ~2.5 minutes at 8 replicas (startup 65-110 s, ``--idle-s``, ~45 s of arrivals
and the last requests' decode), ~4 at 16 (startup ~80 s) and ~6.5 at 32 (startup ~160 s).
What bounds the size on a 2-core, 24 GiB machine: memory first (each engine replica is a Ray
actor, which loads no torch, plus its engine process: the machine's used memory after
startup was 8.0 GB at 16 replicas and 13.9 GB at 32, ~0.37 GB more per replica, so 48 fit
and 64 do not), then startup (the replicas start one after another on 2 cores) and the
host's cores: the idle replicas' stats polls, metrics pushes and KV-event heartbeats (~0.02
CPU-s/s each) and the streamed load share the 2 cores with the load generator, whose sends
run late once they are saturated (``send_lateness_p99_s``).

Failure modes: bad flags exit with argparse's usage error (2). A size that would not fit in
the machine's available memory (``--mb-per-replica`` per engine replica, plus a headroom) is
not started: its rows carry a ``MemoryError`` text, so a run never drives the machine into
the OOM killer. A cluster that exits, is not serving with every
replica within ``--startup-timeout-s`` or fails its warm-up is stopped and its row carries an
``error`` (its simulated half is still filled in); the other cells still run, and the exit
status is then 1. Failed requests are counted in the row. Every cluster and
redis-server is stopped on the way out, also on errors, Ctrl-C (the cells so far are
written; exit 130) and SIGTERM. Server logs go to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from bench.common import free_port, percentile, retry_until_served, sigterm_unwinds
from bench.result_files import RESULTS, result_header
from bench.scale_report import (
    compare,
    counter_from_metrics,
    cpu_rates,
    histogram_delta,
    histogram_from_metrics,
    histogram_summary,
    markdown,
    summarize_records,
    write_report,
)

POLICIES = ("prefix", "least_loaded", "round_robin", "pow2")
BLOCK_SIZE = 16  # the engine's default and the simulator's
TOKEN_LO = 1000
"""Token ids start here: SmolLM2's special tokens and byte tokens lie below."""
MAX_NUM_BATCHED_TOKENS = 512  # EngineConfig's default: the engines' prefill chunk
PREFILL_ORDER = "shortest_first"  # EngineConfig's default
NUM_CPUS_PER_REPLICA = 0.05
"""Ray CPUs each engine replica reserves: N replicas fit in the machine's logical CPUs (the
simulated forward pass is a wait; the replicas share the cores)."""
TIME_FIELDS = ("decode_step_base_s", "decode_step_per_seq_s", "decode_step_per_context_token_s")
RATE_FIELDS = ("prefill_tokens_per_s", "host_to_device_bytes_per_s", "kv_transfer_bytes_per_s")
WARMUP_TOKENS = 8  # under one block: warm-up requests leave nothing in any cache
PREEMPTIONS = "prefixserve:num_preemptions_total"
PULLED_TOKENS = "prefixserve:kv_pull_tokens_total"
METRICS_SETTLE_S = 2.5
"""After the load, before reading ``/metrics``: the replicas and ingresses push their metrics
to the hub every second, so the last requests' lookups and preemptions are in."""
MB_PER_REPLICA = 500
"""Memory a cluster takes per engine replica on the sim engine, the rest of the cluster
included: the machine's used memory after startup was 13.9 GB at 32 replicas (436 MB each)
and grew by ~370 MB per replica from 16 to 32; ``--mb-per-replica`` overrides it."""
MEMORY_HEADROOM_MB = 1000


# -- workload -> token ids ---------------------------------------------------------------------
@lru_cache(maxsize=1 << 16)
def block_token_ids(block_id: int, vocab_size: int) -> tuple[int, ...]:
    """The 16 token ids of simulator block ``block_id``: the id in base ``M = vocab_size -
    TOKEN_LO`` (low digit, then the next), then 14 hashed ids; all in ``[TOKEN_LO,
    vocab_size)``. Distinct ids below ``M * M`` differ in their first or second token."""
    m = vocab_size - TOKEN_LO
    if m < 2 or block_id < 0:
        raise ValueError(f"block id {block_id} or vocabulary {vocab_size} out of range")
    digest = hashlib.blake2b(block_id.to_bytes(16, "big"), digest_size=56).digest()
    rest = [int.from_bytes(digest[4 * i : 4 * i + 4], "big") % m for i in range(BLOCK_SIZE - 2)]
    return tuple(TOKEN_LO + t for t in (block_id % m, (block_id // m) % m, *rest))


def prompt_token_ids(req, vocab_size: int) -> list[int]:
    """A simulator request's prompt: its blocks' tokens, then ``num_prompt_tokens - 16 *
    blocks`` tail tokens of its own (hashed from the request id; never a full block)."""
    ids: list[int] = []
    for block in req.block_ids:
        ids.extend(block_token_ids(block, vocab_size))
    tail = req.num_prompt_tokens - len(ids)
    if tail < 0:
        raise ValueError(f"request {req.request_id}: more blocks than prompt tokens")
    if tail:
        digest = hashlib.blake2b(
            b"tail" + req.request_id.to_bytes(8, "big"), digest_size=4 * tail
        ).digest()
        m = vocab_size - TOKEN_LO
        ids += [
            TOKEN_LO + int.from_bytes(digest[4 * i : 4 * i + 4], "big") % m for i in range(tail)
        ]
    return ids


def shared_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- rates and time scale ------------------------------------------------------------------------
def capacity_req_per_s(prefill_tokens_per_s: float, replicas: int, mean_prompt_tokens: float):
    """Requests/s the cluster can prefill with no cache hits (the simulator's load unit)."""
    return replicas * prefill_tokens_per_s / mean_prompt_tokens


def auto_time_scale(
    prefill_tokens_per_s: float,
    replicas: int,
    mean_prompt_tokens: float,
    offered_load: float,
    rate: float,
) -> float:
    """The slow-down S at which ``offered_load`` of the slowed cluster's capacity is ``rate``
    requests/s; at least 1 (the profile is never sped up)."""
    full = offered_load * capacity_req_per_s(prefill_tokens_per_s, replicas, mean_prompt_tokens)
    return max(1.0, full / rate)


def scaled_profile(profile: dict, scale: float) -> dict:
    """A sim profile's fields (``worker/sim_profiles.json``'s shape) with every time times
    ``scale``: rates divided, step terms multiplied, KV sizes kept."""
    out = dict(profile)
    for name in RATE_FIELDS:
        out[name] = profile[name] / scale
    for name in TIME_FIELDS:
        out[name] = profile[name] * scale
    out["description"] = f"{profile.get('description', '')}, every time x {scale:.3g}"
    return out


def engine_rates(profile: dict, mean_context_tokens: float, source: str):
    """The simulator's ``EngineRates`` for a sim profile: its step ``base + per_seq * (n - 1)``
    is the profile's ``base + (per_seq + per_ctx * ctx) * n`` at the mean context ``ctx``."""
    from bench.sim.calibration import EngineRates

    per_seq = (
        profile["decode_step_per_seq_s"]
        + profile["decode_step_per_context_token_s"] * mean_context_tokens
    )
    return EngineRates(
        prefill_tokens_per_s=profile["prefill_tokens_per_s"],
        decode_step_base_s=profile["decode_step_base_s"] + per_seq,
        decode_step_per_seq_s=per_seq,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        host_to_device_tokens_per_s=profile["host_to_device_bytes_per_s"]
        / profile["kv_bytes_per_token"],
        source=source,
    )


def pull_rates(profile: dict):
    """The simulator's ``PullRates`` for a sim profile: its ``kv_transfer_bytes_per_s``, the
    rate the simulated engine's replicas wait out (``cluster.kv_pull.SimulatedLink``)."""
    from bench.sim.calibration import PullRates

    return PullRates(
        kv_bytes_per_token=profile["kv_bytes_per_token"],
        pull_bytes_per_s=profile["kv_transfer_bytes_per_s"],
        source="the sim profile's kv_transfer_bytes_per_s (bench/scale.py pull_rates)",
    )


def pull_price_tokens_per_s(profile: dict) -> float:
    """The cluster's ``--kv-pull-tokens-per-s``: the rate the simulator's ``prefix`` policy
    prices pulls at (the transfer rate over ``bench/sim/ours.py``'s ``PULL_PRICE_FACTOR``)."""
    from bench.sim.ours import PULL_PRICE_FACTOR

    return pull_rates(profile).pull_tokens_per_s / PULL_PRICE_FACTOR


def pulls_on(args, policy: str) -> bool:
    """Replicas pull prefixes from peers in this cell: ``--kv-pulls`` and the ``prefix``
    policy (the only one whose decisions name a peer to pull from)."""
    return args.kv_pulls and policy == "prefix"


def speculative_ttl_s(prefill_tokens_per_s: float) -> float:
    """The simulator's speculative-entry TTL for this prefill rate (``bench/sim/ours.py``)."""
    from bench.sim.ours import SPECULATIVE_TTL_QUEUE_TOKENS
    from router.config import RouterConfig

    return max(RouterConfig.speculative_ttl_s, SPECULATIVE_TTL_QUEUE_TOKENS / prefill_tokens_per_s)


@dataclasses.dataclass(frozen=True)
class CellPlan:
    """Everything one (size, workload) shares between its policies, real and simulated."""

    replicas: int
    workload: object  # bench.sim.workloads.Workload
    time_scale: float
    profile: dict  # slowed
    rates: object  # bench.sim.calibration.EngineRates
    rate_req_per_s: float
    capacity_req_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    speculative_ttl_s: float


def plan_cell(args, base_profile: dict, replicas: int, workload_name: str) -> CellPlan:
    """The workload at ``replicas`` with arrivals at the slowed profile's capacity."""
    from bench.sim.workloads import WORKLOADS, WorkloadScale

    def scale_at(prefill: float) -> WorkloadScale:
        return WorkloadScale(
            num_replicas=replicas,
            capacity_blocks=args.capacity_blocks,
            block_size=BLOCK_SIZE,
            requests_per_replica=args.requests_per_replica,
            offered_load=args.offered_load,
            prefill_tokens_per_s=prefill,
            seed=args.seed,
        )

    prefill = base_profile["prefill_tokens_per_s"]
    probe = WORKLOADS[workload_name](scale_at(prefill))
    reqs = probe.requests
    mean_prompt = sum(r.num_prompt_tokens for r in reqs) / len(reqs)
    mean_output = sum(r.num_output_tokens for r in reqs) / len(reqs)
    if args.time_scale == "auto":
        s = auto_time_scale(prefill, replicas, mean_prompt, args.offered_load, args.rate)
    else:
        s = float(args.time_scale)
    profile = scaled_profile(base_profile, s)
    workload = WORKLOADS[workload_name](scale_at(profile["prefill_tokens_per_s"]))
    capacity = capacity_req_per_s(profile["prefill_tokens_per_s"], replicas, mean_prompt)
    rates = engine_rates(
        profile,
        mean_prompt + mean_output / 2,
        f"sim profile {args.sim_profile!r} x {s:.3g} (bench/scale.py engine_rates)",
    )
    return CellPlan(
        replicas=replicas,
        workload=workload,
        time_scale=s,
        profile=profile,
        rates=rates,
        rate_req_per_s=args.offered_load * capacity,
        capacity_req_per_s=capacity,
        mean_prompt_tokens=mean_prompt,
        mean_output_tokens=mean_output,
        speculative_ttl_s=speculative_ttl_s(profile["prefill_tokens_per_s"]),
    )


# -- the simulator's half ----------------------------------------------------------------------
def sim_policy(name: str, num_routers: int = 1):
    """The simulator's ``name`` policy; ``prefix`` as ``num_routers`` routers (the cluster's
    ingress replicas: each keeps its own load-bound counts). The cache-blind baselines keep no
    state a second router would split (round robin's counter aside)."""
    from bench.sim import baselines

    if name == "prefix":
        from bench.sim.ours import OursPolicy

        return OursPolicy(num_routers=num_routers)
    return {
        "round_robin": baselines.RoundRobinPolicy,
        "least_loaded": baselines.LeastLoadedPolicy,
        "pow2": baselines.PowerOfTwoPolicy,
    }[name]()


def simulate(args, plan: CellPlan, policy: str) -> dict:
    from bench.sim.simulator import SimConfig, Simulator

    config = SimConfig(
        plan.replicas,
        args.capacity_blocks,
        BLOCK_SIZE,
        0,
        plan.rates,
        args.seed,
        pull_rates(plan.profile) if pulls_on(args, policy) else None,
        PREFILL_ORDER,
    )
    sim = Simulator(config, sim_policy(policy, args.ingress_replicas))
    result = sim.run(plan.workload)
    return {
        "preemptions": result.num_preemptions,
        "kv_waits": result.num_kv_waits,
        "overflow_blocks": sum(r.cache.num_overflow_blocks for r in sim.replicas),
        "hit_rate": result.hit_rate,
        "pulled_token_rate": result.pulled_token_rate,
        "oracle_hit_rate": result.oracle_hit_rate,
        "ttft_p50_s": result.ttft_p50_s,
        "ttft_p90_s": result.ttft_p90_s,
        "ttft_p99_s": result.ttft_p99_s,
        "max_mean_load": result.max_mean_load,
        "output_tok_s": result.output_throughput_tok_s,
    }


# -- the real half: running a cluster ------------------------------------------------------------
def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_folder() -> str:
    from worker.loader import resolve_model

    return str(resolve_model("smollm2", weights=False).path)


def vocab_size(folder: str) -> int:
    return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


class RedisProcess:
    """A throwaway ``redis-server`` on a free loopback port, no persistence."""

    def __init__(self, workdir: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
            + ["--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import socket

        deadline = time.monotonic() + 10.0
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def server_argv(args, plan: CellPlan, policy: str, port: int, profile_path, redis_url):
    argv = [
        sys.executable, "-m", "cluster.cli", "serve", "--model", "smollm2",
        "--engine", "sim", "--sim-profile", str(profile_path),
        "--num-replicas", str(plan.replicas),
        "--num-ingress-replicas", str(args.ingress_replicas),
        "--num-cpus-per-replica", str(NUM_CPUS_PER_REPLICA), "--num-threads", "1",
        "--routing", policy, "--port", str(port),
        "--num-kv-blocks", str(args.capacity_blocks),
        "--speculative-ttl-s", f"{plan.speculative_ttl_s:.3f}",
        "--expose-replica-headers",
    ]  # fmt: skip
    if redis_url:
        argv += ["--redis-url", redis_url]
    if pulls_on(args, policy):
        argv += ["--kv-pull-tokens-per-s", f"{pull_price_tokens_per_s(plan.profile):.1f}"]
    return argv


async def send_open_loop(
    base: str, model: str, prompts, arrivals, max_tokens, timeout_s: float, beside=None
):
    """Every prompt as a streaming completion at its arrival time (open loop); (records,
    duration). ``beside``: a coroutine function started with the run, given its start
    (``time.perf_counter``), and awaited before the records return (``bench/scale_failover.py``
    kills a node from one)."""
    import httpx

    from bench.loadgen.client import RequestOutput, RequestSettings, request_body, send_request

    settings = RequestSettings(base_url=base, model=model, ignore_eos=True, timeout_s=timeout_s)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> dict:
            delay = arrivals[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            out = RequestOutput(i, 0)
            body = request_body(settings, max_tokens[i], prompt=prompts[i])
            await send_request(client, settings, body, out, t0)
            return {
                "index": i,
                "success": out.success,
                "error": out.error,
                "prompt_tokens": out.prompt_len,
                "cached_tokens": out.cached_tokens,
                "output_tokens": out.output_tokens,
                "ttft_s": out.ttft_s,
                "start_s": out.start_s,
                "end_s": out.start_s + out.latency_s,
                "lateness_s": out.start_s - arrivals[i],
                "latency_s": out.latency_s,
                "replica": out.replica,
                "text": out.generated_text,
                "max_gap_s": max(out.itl_s, default=0.0),
            }

        side = asyncio.create_task(beside(t0)) if beside is not None else None
        records = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        if side is not None:
            await side
        duration = time.perf_counter() - t0
    return list(records), duration


def warm_up(base: str, model: str, vocab: int, n: int, patience_s: float = 120.0) -> None:
    """``n`` short requests (under one block: nothing cached) until all succeed."""
    prompts = [[TOKEN_LO + (7919 * i + j) % (vocab - TOKEN_LO) for j in range(WARMUP_TOKENS)]
               for i in range(n)]  # fmt: skip
    retry_until_served(
        lambda: asyncio.run(send_open_loop(base, model, prompts, [0.0] * n, [2] * n, 60.0))[0],
        patience_s,
    )


def _metrics_text(base: str) -> str:
    import httpx

    return httpx.get(base + "/metrics", timeout=10.0).text


def used_memory_mb() -> int:
    import psutil

    vm = psutil.virtual_memory()
    return int((vm.total - vm.available) / 2**20)


def memory_shortfall(replicas: int, mb_per_replica: float, available_mb: float) -> str | None:
    """Why a cluster of ``replicas`` would not fit in ``available_mb``, or None: it takes
    ``mb_per_replica`` per engine replica, and ``MEMORY_HEADROOM_MB`` stays free."""
    need = replicas * mb_per_replica + MEMORY_HEADROOM_MB
    if need <= available_mb:
        return None
    return (
        f"{replicas} replicas need ~{need:.0f} MB ({mb_per_replica:.0f} each, "
        f"{MEMORY_HEADROOM_MB} headroom); {available_mb:.0f} MB available: not started"
    )


ROUTER_HISTOGRAMS = (
    ("router_lookup", "prefixserve:router_lookup_latency_seconds"),
    ("router_decision", "prefixserve:router_decision_latency_seconds"),
    ("router_decision_cpu", "prefixserve:router_decision_cpu_seconds"),
)
"""(row key, ``/metrics`` histogram) of the routers' latencies a cell reports over its load."""


def _same(label: str) -> str:
    """A process's own label as its kind: ``cpu_rates`` per process (Serve's controller, the
    GCS, the index actor, every replica of a deployment summed)."""
    return label


def run_real(args, plan: CellPlan, policy: str, index: str, folder: str, vocab: int) -> dict:
    """One fresh cluster: start, warm up, idle CPU, the load, stop. The row's real half."""
    from bench.host_probe import HostProbe
    from bench.serve.processes import Server, server_env
    from bench.serve.systems import replicas_in_metrics
    from bench.serve_path import cpu_kind

    wl = plan.workload
    prompts = [prompt_token_ids(r, vocab) for r in wl.requests]
    arrivals = [r.arrival_s - wl.requests[0].arrival_s for r in wl.requests]
    max_tokens = [r.num_output_tokens for r in wl.requests]
    out: dict = {}
    redis = srv = None
    import psutil

    short = memory_shortfall(
        plan.replicas, args.mb_per_replica, psutil.virtual_memory().available / 2**20
    )
    if short:
        return {"error": f"MemoryError: {short}"}
    tmp = tempfile.mkdtemp(prefix="scale_")
    try:
        redis_url = None
        if index == "redis":
            if args.redis_url:
                redis_url = args.redis_url
            else:
                redis = RedisProcess(tmp)
                redis_url = redis.url
        profile_path = Path(tmp) / "profile.json"
        profile_path.write_text(json.dumps(plan.profile))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        argv = server_argv(args, plan, policy, port, profile_path, redis_url)
        out["command"] = " ".join(argv[1:])
        name = f"{plan.replicas}x_{policy}_{index}_{wl.name}"
        srv = Server(name, argv, args.log_dir / f"scale_{args.tag}_{name}.log", server_env(1))
        t0 = time.monotonic()
        srv.wait_ready(
            base + "/health",
            args.startup_timeout_s,
            ready=lambda: replicas_in_metrics(base) >= plan.replicas,
        )
        out["startup_s"] = round(time.monotonic() - t0, 1)
        from bench.cluster_process import ROUTERS_SETTLE_S

        time.sleep(ROUTERS_SETTLE_S)
        from bench.loadgen.client import first_model

        model = first_model(base)
        warm_up(base, model, vocab, 2 * plan.replicas)
        out["memory_used_mb"] = used_memory_mb()
        c0 = srv.cpu_by_process()
        time.sleep(args.idle_s)
        c_idle = srv.cpu_by_process()
        idle = cpu_rates(c0, c_idle, args.idle_s, cpu_kind)
        out["idle_cpu_s_per_s"] = idle
        out["idle_cpu_s_per_s_by_process"] = cpu_rates(c0, c_idle, args.idle_s, _same)
        out["idle_cpu_s_per_s_per_engine_replica"] = round(
            (idle.get("replica", 0.0) + idle.get("engine", 0.0)) / plan.replicas, 4
        )
        out["idle_cpu_s_per_s_total"] = round(sum(idle.values()), 3)
        text0 = _metrics_text(base)
        before = {key: histogram_from_metrics(text0, name) for key, name in ROUTER_HISTOGRAMS}
        c1, t1 = srv.cpu_by_process(), time.monotonic()
        probe = HostProbe().start()
        try:
            records, duration = asyncio.run(
                send_open_loop(base, model, prompts, arrivals, max_tokens, args.request_timeout_s)
            )
        finally:
            out["host_burst"] = probe.stop()
        c_load, load_s = srv.cpu_by_process(), time.monotonic() - t1
        out["load_cpu_s_per_s"] = cpu_rates(c1, c_load, load_s, cpu_kind)
        out["load_cpu_s_per_s_by_process"] = cpu_rates(c1, c_load, load_s, _same)
        time.sleep(METRICS_SETTLE_S)
        text1 = _metrics_text(base)
        out["preemptions"] = int(
            counter_from_metrics(text1, PREEMPTIONS) - counter_from_metrics(text0, PREEMPTIONS)
        )
        for key, name in ROUTER_HISTOGRAMS:
            delta = histogram_delta(histogram_from_metrics(text1, name), before[key])
            out[key] = histogram_summary(delta)
        out.update(summarize_records(records, plan.replicas, duration))
        pulled = counter_from_metrics(text1, PULLED_TOKENS) - counter_from_metrics(
            text0, PULLED_TOKENS
        )
        out["pulled_token_rate"] = pulled / out["prompt_tokens"] if out["prompt_tokens"] else None
        late = sorted(r["lateness_s"] for r in records)
        out["send_lateness_p99_s"] = round(percentile(late, 99), 4)
        out["requests"] = [
            {k: r[k] for k in ("index", "replica", "cached_tokens", "ttft_s", "start_s")}
            for r in records
        ]
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if srv is not None:
            srv.stop()
        if redis is not None:
            redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- main ----------------------------------------------------------------------------------------
def add_cell_flags(p: argparse.ArgumentParser) -> None:
    """The flags that shape a cell's cluster and workload (``plan_cell`` reads them), shared
    with ``bench/scale_failover.py``."""
    p.add_argument("--requests-per-replica", type=int, default=20)
    p.add_argument("--capacity-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--offered-load", type=float, default=0.8)
    p.add_argument("--rate", type=float, default=6.0, help="req/s the auto time scale aims at")
    p.add_argument("--time-scale", default="auto", help="'auto' or a number >= 1")
    p.add_argument("--sim-profile", default="gpu", help="a preset of worker/sim_profiles.json")
    p.add_argument("--ingress-replicas", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-pulls",
        action="store_true",
        help="prefix routing with KV pulls: a replica lacking a prefix a peer holds pulls it "
        "over the profile's kv_transfer_bytes_per_s, priced as the simulator prices it",
    )


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """Timeouts and where results and logs go, shared with ``bench/scale_failover.py``."""
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--tag", default=None, help="file name suffix (default: the UTC date)")
    p.add_argument("--log-dir", type=Path, default=None, help="default $TMPDIR/scale_logs")


def build_parser() -> argparse.ArgumentParser:
    from bench.sim.workloads import WORKLOADS

    p = argparse.ArgumentParser(
        prog="python -m bench.scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument(
        "--index",
        nargs="+",
        choices=("embedded", "redis"),
        default=None,
        help="default: embedded, and redis with --redis-url or a redis-server binary",
    )
    p.add_argument("--redis-url", default=None)
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                   default=["generated_shared_prefix"])  # fmt: skip
    add_cell_flags(p)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument(
        "--mb-per-replica",
        type=float,
        default=MB_PER_REPLICA,
        help="memory an engine replica takes; a size that would not fit is not started",
    )
    p.add_argument("--no-real", action="store_true", help="the simulator's half only")
    add_run_flags(p)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.time_scale != "auto":
        try:
            if float(args.time_scale) < 1:
                raise ValueError
        except ValueError:
            p.error("--time-scale: 'auto' or a number >= 1")
    if min(args.replicas) < 1 or args.requests_per_replica < 1 or args.capacity_blocks < 1:
        p.error("--replicas, --requests-per-replica and --capacity-blocks must be >= 1")
    if not (args.offered_load > 0 and args.rate > 0 and args.idle_s > 0):
        p.error("--offered-load, --rate and --idle-s must be positive")
    if args.index is None:
        args.index = ["embedded"]
        if args.redis_url or shutil.which("redis-server"):
            args.index.append("redis")
    needs_redis = "redis" in args.index and not args.no_real
    if needs_redis and not args.redis_url and not shutil.which("redis-server"):
        p.error("--index redis needs --redis-url or a redis-server binary")
    args.tag = args.tag or time.strftime("%Y-%m-%d", time.gmtime())
    args.log_dir = args.log_dir or Path(tempfile.gettempdir()) / "scale_logs"
    return args


def load_base_profile(name: str) -> dict:
    from worker.sim_model import PRESETS_PATH

    presets = json.loads(PRESETS_PATH.read_text())
    if name not in presets:
        raise SystemExit(f"--sim-profile: {name!r} is not one of {', '.join(sorted(presets))}")
    return presets[name]


def run_all(args, header: dict, rows: list[dict]) -> None:
    base_profile = load_base_profile(args.sim_profile)
    folder = vocab = None
    if not args.no_real:
        folder = model_folder()
        vocab = vocab_size(folder)
    cells = [
        (n, w, i, p)
        for n in args.replicas
        for w in args.workloads
        for i in args.index
        for p in args.policies
    ]
    plans: dict = {}
    sims: dict = {}  # the simulator has no index backend: one run per (size, workload, policy)
    for k, (n, wname, index, policy) in enumerate(cells, 1):
        if (n, wname) not in plans:
            plans[n, wname] = plan_cell(args, base_profile, n, wname)
        plan = plans[n, wname]
        row = {
            "replicas": n,
            "workload": wname,
            "index": index,
            "policy": policy,
            "kv_pulls": pulls_on(args, policy),
            "time_scale": plan.time_scale,
            "rate_req_per_s": plan.rate_req_per_s,
            "capacity_req_per_s": plan.capacity_req_per_s,
            "offered_load": args.offered_load,
            "num_requests_planned": len(plan.workload.requests),
            "mean_prompt_tokens": plan.mean_prompt_tokens,
            "mean_output_tokens": plan.mean_output_tokens,
            "speculative_ttl_s": plan.speculative_ttl_s,
            "workload_description": plan.workload.description,
            "sim_rates": dataclasses.asdict(plan.rates),
        }
        _progress(
            f"[{k}/{len(cells)}] {n} replicas, {policy}, {index}, {wname}: start "
            f"(S={plan.time_scale:.3g}, {plan.rate_req_per_s:.2f} req/s, "
            f"{len(plan.workload.requests)} requests)"
        )
        t0 = time.monotonic()
        if (n, wname, policy) not in sims:
            sims[n, wname, policy] = simulate(args, plan, policy)
        row["sim"] = sims[n, wname, policy]
        if args.no_real:
            row["error"] = "not run (--no-real)"
        else:
            row.update(run_real(args, plan, policy, index, folder, vocab))
        if "error" not in row:
            row.update(compare(row, row["sim"]))
        row["cell_wall_s"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        write_report(args.out_dir, args.tag, header, rows, with_plot=False)
        sim = row["sim"]
        _progress(
            f"[{k}/{len(cells)}] end in {row['cell_wall_s']:.0f} s: "
            + (
                f"error: {row['error']}"
                if "error" in row
                else f"hit {row['hit_rate']:.3f} (sim {sim['hit_rate']:.3f}), TTFT p90 "
                f"{row['ttft_p90_s']:.3f} s (sim {sim['ttft_p90_s']:.3f}), "
                f"{row['failed']} failed, startup {row['startup_s']:.0f} s"
            )
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    header = {
        **result_header("scale", "bench.scale", argv),
        "replicas": args.replicas,
        "policies": args.policies,
        "index": args.index,
        "workloads": args.workloads,
        "requests_per_replica": args.requests_per_replica,
        "capacity_blocks": args.capacity_blocks,
        "offered_load": args.offered_load,
        "rate": args.rate,
        "time_scale": args.time_scale,
        "sim_profile": args.sim_profile,
        "ingress_replicas": args.ingress_replicas,
        "num_cpus_per_replica": NUM_CPUS_PER_REPLICA,
        "seed": args.seed,
        "memory_total_mb": _total_memory_mb(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "log_dir": str(args.log_dir),
        "note": "Every time of the sim profile is multiplied by S so that this machine's "
        "cores can drive the offered load; real and simulated seconds are the same seconds "
        "(see bench/scale.py's docstring).",
    }
    rows: list[dict] = []
    interrupted = False
    try:
        with sigterm_unwinds():
            run_all(args, header, rows)
    except KeyboardInterrupt:
        interrupted = True
        _progress("interrupted: every cluster stopped; writing the cells so far")
    finally:
        header["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        header["interrupted"] = interrupted
        paths = write_report(args.out_dir, args.tag, header, rows)
    print(markdown(rows))
    print("wrote " + ", ".join(str(p) for p in paths))
    if interrupted:
        return 130
    return 1 if any("error" in r for r in rows) else 0


def _total_memory_mb() -> int:
    import psutil

    return int(psutil.virtual_memory().total / 2**20)


if __name__ == "__main__":
    sys.exit(main())
