"""Losing a node at cluster scale: simulated engine replicas on two Ray nodes, one node killed
mid-run, and what the clients saw.

    python -m bench.scale_failover                            # 16 replicas, 8 on each node
    python -m bench.scale_failover --replicas 8 --kill-at 0.3 --tag smoke

The cluster: two Ray nodes on this machine (``bench/ray_nodes.py``: each a ``ray start
--block`` in a session of its own), node A the head and node B joined to it, each with
``replicas / 2`` logical CPUs; every engine replica reserves one CPU, so half of them land on
each node. The app is ``bench/scale.py``'s (simulated engines with its slowed ``gpu`` profile,
prefix routing, ``--capacity-blocks`` KV blocks per replica, ``--ingress-replicas`` ingress
replicas) with the Redis index (a throwaway ``redis-server`` on a free loopback port: the
index outlives either node), built and run by this process as the Ray driver, Serve's proxy on
the head only. The ingress replicas are pinned to node A (a sliver of its ``node_a``
resource): the node lost is one of engines, the clients' HTTP streams stay up.

The run: the workload of ``bench/scale.py`` at the same size, seed and offered load (open
loop through node A's proxy, streaming completions with token-id prompts), and
``--kill-at`` of the way through its arrivals every process of node B is SIGKILLed (raylet,
agents, workers, engine processes): half the engine replicas die mid-stream, and the requests
that arrive after the kill find half the capacity. Nothing is left to chance in the text:
before the cluster starts, the simulated engine runs offline in this process on every prompt
(its tokens are a function of prompt and position, whatever the schedule), and every stream
is compared with that text.

Per run (one JSON row, markdown and a PNG): failed requests (the target is 0), streams whose
text differs from the offline run (0), requests in flight on node B's replicas at the kill
(by the ``x-prefixserve-replica`` header: the replica that started the stream) and their
longest gap between two text chunks (the stall a client saw, beside the other streams'), failovers
the ingress replicas logged (``resuming on another``), seconds until the GCS declared node B
dead, seconds until Redis held no key or liveness entry of node B's replicas (the index
purged), TTFT p50/p90/p99 and hit rate before the kill, in the 30 s after it and later, the
end-to-end latency of the streams that failed over, and the replicas that served each phase.
The PNG: each request's TTFT by its send time, coloured by the node of the replica that
started it, the kill marked; below, completions per second by completion time.

What bounds it: memory (``bench/scale.py``: ~0.4 GB per engine replica) and this machine's two
cores, which host both nodes, Redis and the load generator. After the kill node A carries the
whole offered load on half the replicas (twice its capacity), so queues build up until the
arrivals end: TTFTs after the kill measure that overload, not the failover.

Failure modes: bad flags exit with argparse's usage error (2). A cluster that is not serving
with every replica within ``--startup-timeout-s`` raises; the nodes and Redis are stopped on
the way out (also on Ctrl-C and SIGTERM), and the exit status is 1 when any request failed or
any text differed. Node logs go to ``--log-dir``, and node A's Serve logs (where the ingress
replicas log each failover) to ``<log-dir>/scale_failover_<tag>_serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

from bench import ray_nodes
from bench.common import free_ports, percentile, sigterm_unwinds
from bench.result_files import result_header

APP_NAME = "scalefailover"
FAILOVER_LOG = "resuming on another"
"""What ``cluster/engine_client.py`` logs when a stream fails over to another replica."""
AFTER_KILL_WINDOW_S = 30.0
"""Requests sent within this long after the kill form the "just after" phase."""
WATCH_TIMEOUT_S = 180.0
"""How long after the kill ``AfterKill`` waits for node B's death and the index's purge."""
WATCH_PERIOD_S = 0.5
REPO_ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    from bench.scale import add_cell_flags, add_run_flags
    from bench.sim.workloads import WORKLOADS

    p = argparse.ArgumentParser(
        prog="python -m bench.scale_failover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=16, help="engine replicas, half per node")
    p.add_argument("--kill-at", type=float, default=0.4, help="fraction of the arrival span")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="generated_shared_prefix")
    add_cell_flags(p)
    add_run_flags(p)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.replicas < 2 or args.replicas % 2:
        p.error("--replicas: an even number >= 2 (half on each node)")
    if not 0 < args.kill_at < 1:
        p.error("--kill-at: a fraction of the arrival span, in (0, 1)")
    if shutil.which("redis-server") is None:
        p.error("needs a redis-server binary (Debian: apt-get install -y redis-server)")
    args.tag = args.tag or time.strftime("%Y-%m-%d", time.gmtime())
    args.log_dir = args.log_dir or Path(tempfile.gettempdir()) / "scale_logs"
    return args


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the fault-free text ---------------------------------------------------------------------
def offline_texts(prompts: list[list[int]], max_tokens: list[int]) -> list[str]:
    """Each prompt's text from the simulated engine in this process (unslowed profile: the
    tokens do not depend on timing or batching)."""
    from worker import LLM, SamplingParams

    llm = LLM("smollm2", engine="sim", sim_profile="gpu", max_num_seqs=256)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [out.outputs[0].text for out in outputs]


# -- the cluster -----------------------------------------------------------------------------
class TwoNodeCluster:
    """Redis, node A (head) and node B, and the app on them; ``close`` stops it all."""

    def __init__(self, args, plan, workdir: Path) -> None:
        from bench.scale import RedisProcess

        self.nodes: list[ray_nodes.RayNode] = []
        self.redis = RedisProcess(str(workdir))
        self.profile_path = workdir / "profile.json"
        self.profile_path.write_text(json.dumps(plan.profile))
        gcs, client_port, dashboard, self.http_port = free_ports(4)
        self.url = f"http://127.0.0.1:{self.http_port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
        env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        per_node = args.replicas // 2
        deadline = time.monotonic() + args.startup_timeout_s
        head = [
            "--head", "--port", str(gcs), "--ray-client-server-port", str(client_port),
            "--include-dashboard", "false", "--dashboard-port", str(dashboard),
        ]  # fmt: skip
        self.nodes.append(
            ray_nodes.start_node(
                "a", head, env, args.log_dir, ray_nodes.HEALTH_CHECK_ENV, num_cpus=per_node
            )
        )
        ray_nodes.wait_for_port(gcs, self.nodes[0], deadline)
        self.nodes.append(
            ray_nodes.start_node(
                "b", ["--address", f"127.0.0.1:{gcs}"], env, args.log_dir, num_cpus=per_node
            )
        )
        import ray

        ray.init(address=f"127.0.0.1:{gcs}", log_to_driver=False)
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if self.nodes[1].process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node b did not join:\n{self.nodes[1].log_tail()}")
            time.sleep(0.2)
        self.node_ids = ray_nodes.node_ids(["a", "b"])
        self._run_app(args, plan)
        self.engines = self._wait_serving(args, deadline)

    def _run_app(self, args, plan) -> None:
        from ray import serve

        from cluster import app as app_module

        serve.start(
            proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": self.http_port}
        )
        config = {
            "engine": {
                "model": "smollm2",
                "engine": "sim",
                "sim_profile": str(self.profile_path),
                "num_kv_blocks": args.capacity_blocks,
                "num_threads": 1,
            },
            "cluster": {
                "num_replicas": args.replicas,
                "num_ingress_replicas": args.ingress_replicas,
                "num_cpus_per_replica": 1,  # half the replicas fill each node's CPUs
                "expose_replica_headers": True,
                "port": self.http_port,
                "app_name": APP_NAME,
            },
            "router": {
                "policy": "prefix",
                "index_backend": "redis",
                "redis_url": self.redis.url,
                "speculative_ttl_s": round(plan.speculative_ttl_s, 3),
            },
        }
        ingress_options = app_module.ingress_options

        def on_node_a(cluster_config) -> dict:
            options = ingress_options(cluster_config)
            actor = options["ray_actor_options"]
            return {**options, "ray_actor_options": {**actor, "resources": {"node_a": 0.001}}}

        with mock.patch.object(app_module, "ingress_options", on_node_a):
            app = app_module.build_app(config)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)

    def _wait_serving(self, args, deadline: float) -> dict[str, str]:
        """{engine replica id: node name} once /health answers with every replica running."""
        import httpx

        names = {node_id: name for name, node_id in self.node_ids.items()}
        while True:
            with contextlib.suppress(httpx.HTTPError, RuntimeError):
                healthy = httpx.get(self.url + "/health", timeout=5).status_code == 200
                details = ray_nodes.serve_details()
                engines = ray_nodes.replicas_by_node(details, APP_NAME, "EngineReplica")
                ingresses = ray_nodes.replicas_by_node(details, APP_NAME, "Ingress")
                if (
                    healthy
                    and len(engines) == args.replicas
                    and len(ingresses) == (args.ingress_replicas)
                ):
                    return {rid: names[node] for rid, node in engines.items()}
            for node in self.nodes:
                if node.process.poll() is not None:
                    raise RuntimeError(f"node {node.name} died:\n{node.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError("the app did not come up with every replica in time")
            time.sleep(1.0)

    def close(self, keep_logs: Path | None = None) -> None:
        """Stops the nodes and Redis; ``keep_logs``: a folder that gets node A's Serve logs
        (ingress and engine replicas, controller, proxy) first."""
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()
        if keep_logs is not None and self.nodes:
            for folder in Path(self.nodes[0].temp_dir).glob("session_*/logs/serve"):
                shutil.copytree(folder, keep_logs, dirs_exist_ok=True)
        for node in reversed(self.nodes):
            ray_nodes.stop_node(node)
        self.redis.stop()


def index_holds(redis_url: str, replica_ids: list[str]) -> dict[str, list[str]]:
    """What Redis still holds of the lost replicas: {replica id: its liveness entry
    (``replicas``) and the kinds of its keys (``dev``, ``host``, ``spec``, ``stream``)}, for
    those it holds anything of."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = [k.decode() for k in client.scan_iter("prefixserve:*", count=1000)]
        live = set()
        for key in keys:
            if key.endswith(":replicas"):
                live.update(r.decode() for r in client.hkeys(key))
    finally:
        client.close()
    held: dict[str, list[str]] = {}
    for rid in replica_ids:
        mine = [k.rsplit(f":{rid}", 1)[0] for k in keys if f":{rid}" in k]
        kinds = sorted({k.rsplit(":", 1)[-1] for k in mine})
        if rid in live:
            kinds.insert(0, "replicas")
        if kinds:
            held[rid] = kinds
    return held


def liveness_deadlines(redis_url: str, replica_ids: list[str]) -> dict[str, float]:
    """{replica id: seconds until its liveness deadline in Redis (negative: past)} of those of
    ``replica_ids`` that have one; the deadlines are the replicas' wall clocks."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        out = {}
        for key in client.scan_iter("prefixserve:*:replicas", count=1000):
            for rid, deadline in client.hgetall(key).items():
                if rid.decode() in replica_ids:
                    out[rid.decode()] = round(float(deadline) - time.time(), 2)
    finally:
        client.close()
    return out


# -- the run ---------------------------------------------------------------------------------
def drive(
    url: str,
    model: str,
    prompts: list[list[int]],
    arrivals: list[float],
    max_tokens: list[int],
    timeout_s: float,
    kill_after_s: float,
    kill,
) -> tuple[list[dict], float, float]:
    """``bench/scale.py``'s open loop, with ``kill()`` run (in a thread) ``kill_after_s`` in;
    (records, duration, kill time from the start)."""
    from bench.scale import send_open_loop

    killed_at: list[float] = []

    async def killer(t0: float) -> None:
        await asyncio.sleep(kill_after_s)
        killed_at.append(time.perf_counter() - t0)
        await asyncio.to_thread(kill)

    records, duration = asyncio.run(
        send_open_loop(url, model, prompts, arrivals, max_tokens, timeout_s, beside=killer)
    )
    return records, duration, killed_at[0]


def phase_figures(records: list[dict]) -> dict:
    ok = [r for r in records if r["success"]]
    ttfts = [r["ttft_s"] for r in ok]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "num_requests": len(records),
        "failed": len(records) - len(ok),
        "hit_rate": round(sum(r["cached_tokens"] or 0 for r in ok) / prompt, 4) if prompt else None,
        "ttft_p50_s": round(percentile(ttfts, 50), 3) if ttfts else None,
        "ttft_p90_s": round(percentile(ttfts, 90), 3) if ttfts else None,
        "ttft_p99_s": round(percentile(ttfts, 99), 3) if ttfts else None,
        "replicas_used": len({r["replica"] for r in ok}),
    }


def run(args) -> dict:
    from bench.cluster_process import ROUTERS_SETTLE_S
    from bench.loadgen.client import first_model
    from bench.scale import (
        load_base_profile,
        plan_cell,
        prompt_token_ids,
        vocab_size,
        warm_up,
    )
    from bench.scale import model_folder as smollm2_folder

    plan = plan_cell(args, load_base_profile(args.sim_profile), args.replicas, args.workload)
    wl = plan.workload
    vocab = vocab_size(smollm2_folder())
    prompts = [prompt_token_ids(r, vocab) for r in wl.requests]
    arrivals = [r.arrival_s - wl.requests[0].arrival_s for r in wl.requests]
    max_tokens = [r.num_output_tokens for r in wl.requests]
    row: dict = {
        "replicas": args.replicas,
        "workload": wl.name,
        "time_scale": plan.time_scale,
        "rate_req_per_s": plan.rate_req_per_s,
        "num_requests": len(prompts),
        "kill_at_fraction": args.kill_at,
    }
    _progress(f"offline texts of {len(prompts)} requests (simulated engine, this process)")
    expected = offline_texts(prompts, max_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="scale_failover_"))
    cluster = None
    try:
        _progress(f"starting two nodes, {args.replicas} engine replicas, Redis")
        t0 = time.monotonic()
        cluster = TwoNodeCluster(args, plan, workdir)
        row["startup_s"] = round(time.monotonic() - t0, 1)
        on_b = sorted(r for r, node in cluster.engines.items() if node == "b")
        row["replicas_by_node"] = {
            name: sorted(r for r, node in cluster.engines.items() if node == name)
            for name in ("a", "b")
        }
        time.sleep(ROUTERS_SETTLE_S)
        model = first_model(cluster.url)
        warm_up(cluster.url, model, vocab, 2 * args.replicas)
        node_b = cluster.nodes[1]
        kill_after_s = args.kill_at * arrivals[-1]
        killed: dict = {}

        def kill() -> None:
            processes = node_b.processes()
            killed["processes"] = len(processes)
            wall = time.monotonic()
            ray_nodes.kill_all(processes)
            killed["watch"] = AfterKill(cluster, on_b, wall)

        _progress(
            f"serving after {row['startup_s']:.0f} s; {len(prompts)} requests over "
            f"{arrivals[-1]:.0f} s, node b killed {kill_after_s:.0f} s in"
        )
        records, duration, killed_s = drive(
            cluster.url, model, prompts, arrivals, max_tokens,
            args.request_timeout_s, kill_after_s, kill,
        )  # fmt: skip
        row["duration_s"] = round(duration, 1)
        row["killed_at_s"] = round(killed_s, 2)
        row["node_b_processes_killed"] = killed["processes"]
        row.update(outcome(records, expected, on_b, killed_s))
        row["failovers_logged"] = len(ray_nodes.ingress_log_lines(cluster.nodes[0], FAILOVER_LOG))
        row.update(killed["watch"].result())
        row["requests"] = [
            {k: r[k] for k in ("index", "replica", "ttft_s", "start_s", "end_s", "success")}
            for r in records
        ]
        return row
    finally:
        if cluster is not None:
            cluster.close(keep_logs=args.log_dir / f"scale_failover_{args.tag}_serve")
        shutil.rmtree(workdir, ignore_errors=True)


def outcome(records: list[dict], expected: list[str], on_b: list[str], killed_s: float) -> dict:
    """What the clients saw: failures, texts, and the phases around the kill."""
    lost = set(on_b)
    in_flight = [
        r for r in records if r["replica"] in lost and r["start_s"] <= killed_s < r["end_s"]
    ]
    mismatched = [r["index"] for r in records if r["success"] and r["text"] != expected[r["index"]]]
    before = [r for r in records if r["start_s"] < killed_s]
    just_after = [r for r in records if killed_s <= r["start_s"] < killed_s + AFTER_KILL_WINDOW_S]
    later = [r for r in records if r["start_s"] >= killed_s + AFTER_KILL_WINDOW_S]
    return {
        "failed": sum(not r["success"] for r in records),
        "errors": sorted({r["error"][:200] for r in records if not r["success"]})[:5],
        "texts_differing": len(mismatched),
        "texts_differing_indices": mismatched[:20],
        "in_flight_on_b_at_kill": len(in_flight),
        "in_flight_on_b_completed": sum(r["success"] for r in in_flight),
        "failed_over_latency_p50_s": round(
            percentile([r["latency_s"] for r in in_flight if r["success"]], 50), 3
        ),
        "failed_over_stall_p50_s": round(
            percentile([r["max_gap_s"] for r in in_flight if r["success"]], 50), 3
        ),
        "failed_over_stall_max_s": round(
            max((r["max_gap_s"] for r in in_flight if r["success"]), default=0.0), 3
        ),
        "others_stall_p50_s": round(
            percentile(
                [r["max_gap_s"] for r in records if r["success"] and r not in in_flight], 50
            ),
            3,
        ),
        "sent_after_kill_on_b": sum(
            1 for r in records if r["start_s"] > killed_s + 1.0 and r["replica"] in lost
        ),
        "phases": {
            "before_kill": phase_figures(before),
            f"first_{AFTER_KILL_WINDOW_S:.0f}s_after": phase_figures(just_after),
            "later": phase_figures(later),
            "all": phase_figures(records),
        },
    }


class AfterKill:
    """Watches, from the kill on and while the load runs, when the GCS declares node B dead
    (``node_b_declared_dead_after_s``), when Redis last holds a liveness entry of node B's
    replicas (``liveness_gone_after_s``) and anything of theirs (``index_purged_after_s``);
    None where that did not happen within ``WATCH_TIMEOUT_S``. Polls every
    ``WATCH_PERIOD_S`` in a thread of its own."""

    def __init__(self, cluster: TwoNodeCluster, lost: list[str], killed_wall: float) -> None:
        self._cluster, self._lost, self._killed_wall = cluster, lost, killed_wall
        self.figures: dict = {
            "node_b_declared_dead_after_s": None,
            "liveness_gone_after_s": None,
            "index_purged_after_s": None,
            "liveness_deadlines_at_kill_s": liveness_deadlines(cluster.redis.url, lost),
        }
        self._thread = threading.Thread(target=self._run, name="after-kill", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        f, node_b = self.figures, self._cluster.node_ids["b"]
        while True:
            since_s = round(time.monotonic() - self._killed_wall, 1)
            if f["node_b_declared_dead_after_s"] is None and not any(
                n["Alive"] for n in ray.nodes() if n["NodeID"] == node_b
            ):
                f["node_b_declared_dead_after_s"] = since_s
            held = index_holds(self._cluster.redis.url, self._lost)
            if f["liveness_gone_after_s"] is None and not any(
                "replicas" in kinds for kinds in held.values()
            ):
                f["liveness_gone_after_s"] = since_s
            if f["index_purged_after_s"] is None and not held:
                f["index_purged_after_s"] = since_s
            f["index_still_holds"] = held
            done = f["node_b_declared_dead_after_s"] is not None and not held
            if done or since_s > WATCH_TIMEOUT_S:
                return
            time.sleep(WATCH_PERIOD_S)

    def result(self) -> dict:
        """The figures, once the watch ended (waits for it)."""
        self._thread.join()
        return self.figures


# -- report ----------------------------------------------------------------------------------
def markdown(row: dict) -> str:
    if "error" in row:
        return f"error: {row['error']}\n"
    lines = [
        f"{row['replicas']} simulated replicas ({len(row['replicas_by_node']['a'])} on node A, "
        f"{len(row['replicas_by_node']['b'])} on node B), {row['num_requests']} requests at "
        f"{row['rate_req_per_s']:.2f} req/s ({row['workload']}, time scale "
        f"{row['time_scale']:.3g}); node B killed at {row['killed_at_s']:.1f} s "
        f"({row['node_b_processes_killed']} processes).",
        "",
        f"- failed requests: **{row['failed']}**; texts differing from the offline run: "
        f"**{row['texts_differing']}**",
        f"- in flight on node B's replicas at the kill: {row['in_flight_on_b_at_kill']}, "
        f"completed {row['in_flight_on_b_completed']} (latency p50 "
        f"{row['failed_over_latency_p50_s']} s; their longest gap between two chunks p50 "
        f"{row['failed_over_stall_p50_s']} s, max {row['failed_over_stall_max_s']} s, against "
        f"{row['others_stall_p50_s']} s for the other streams); failovers logged: "
        f"{row['failovers_logged']}",
        f"- node B declared dead {row['node_b_declared_dead_after_s']} s after the kill; "
        f"Redis held no liveness entry of its replicas {row['liveness_gone_after_s']} s "
        f"after it, nothing of theirs {row['index_purged_after_s']} s after it"
        + (f" (still held: {row['index_still_holds']})" if row["index_still_holds"] else ""),
        "",
        "| phase | requests | failed | hit rate | TTFT p50 | p90 | p99 | replicas used |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, f in row["phases"].items():
        lines.append(
            f"| {name} | {f['num_requests']} | {f['failed']} | {f['hit_rate']} | "
            f"{f['ttft_p50_s']} | {f['ttft_p90_s']} | {f['ttft_p99_s']} | {f['replicas_used']} |"
        )
    return "\n".join(lines) + "\n"


def plot(row: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    node_of = {r: name for name, rs in row["replicas_by_node"].items() for r in rs}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})  # fmt: skip
    for name, colour in (("a", "tab:blue"), ("b", "tab:orange")):
        reqs = [r for r in row["requests"] if r["success"] and node_of.get(r["replica"]) == name]
        top.scatter([r["start_s"] for r in reqs], [r["ttft_s"] for r in reqs], s=8, c=colour,
                    label=f"started on node {name.upper()}")  # fmt: skip
    failed = [r for r in row["requests"] if not r["success"]]
    if failed:
        top.scatter([r["start_s"] for r in failed], [0] * len(failed), marker="x", c="red",
                    label="failed")  # fmt: skip
    ends = sorted(r["end_s"] for r in row["requests"] if r["success"])
    width = 2.0
    bins = int(ends[-1] / width) + 1 if ends else 1
    counts = [0] * bins
    for t in ends:
        counts[int(t / width)] += 1
    bottom.bar([i * width for i in range(bins)], [c / width for c in counts], width=width,
               align="edge", color="tab:gray")  # fmt: skip
    for ax in (top, bottom):
        ax.axvline(row["killed_at_s"], color="red", linestyle="--")
    top.set_ylabel("TTFT (s)")
    top.set_xlabel("send time (s since the first request)")
    top.tick_params(labelbottom=True)
    top.set_yscale("log")
    top.legend(loc="upper left")
    top.set_title(
        f"{row['replicas']} simulated replicas on 2 nodes, node B killed at "
        f"{row['killed_at_s']:.0f} s: {row['failed']} failed, "
        f"{row['texts_differing']} texts differ, {row['in_flight_on_b_at_kill']} streams moved"
    )
    bottom.set_ylabel("completions/s")
    bottom.set_xlabel("completion time (s since the first request)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    header = {
        **result_header("scale_failover", "bench.scale_failover", argv),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "log_dir": str(args.log_dir),
    }
    row: dict = {}
    try:
        with sigterm_unwinds():
            row = run(args)
    except KeyboardInterrupt:
        row = {"error": "interrupted"}
    except Exception as exc:  # noqa: BLE001 - the result file says what went wrong
        row = {"error": f"{type(exc).__name__}: {exc}"}
    header["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    stem = args.out_dir / f"scale_failover_{args.tag}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({**header, "rows": [row]}, indent=1) + "\n")
    text = markdown(row)
    stem.with_suffix(".md").write_text(f"# bench.scale_failover, {header['date']}\n\n{text}")
    if "error" not in row:
        plot(row, stem.with_suffix(".png"))
    print(text)
    print(f"wrote {stem}.json, .md" + (", .png" if "error" not in row else ""))
    if "error" in row:
        return 130 if row["error"] == "interrupted" else 1
    return 1 if row["failed"] or row["texts_differing"] else 0


if __name__ == "__main__":
    sys.exit(main())
