"""Two Ray nodes on one machine: one prefix index behind two proxies, and a lost node
is a fault the cluster survives.

The module starts its own Ray cluster of two nodes (``bench/ray_nodes.py``: each a separate
``ray start --block`` in a session of its own): the head (node A) and a second node (node B)
joined to the head's GCS. Each node has one logical CPU and an
engine replica reserves one, so the two engine replicas land one on each node; the ingress is
pinned to one replica per node (``max_replicas_per_node``, set by the test).

Serve runs a proxy on every node (``proxy_location="EveryNode"``). Every proxy binds the same
``http_options`` host and port whatever its node's address, so two proxies on one host collide;
Serve's per-worker-node knob ``RAY_SERVE_WORKER_PROXY_HTTP_PORT``, in node B's environment,
moves node B's proxy to a port of its own. A proxy prefers the ingress replica on its own node,
so requests through proxy A and proxy B are routed by two different routers, which share one
prefix index: a ``redis-server`` on a free loopback port.

1. A prompt with a long shared prefix through proxy A, then a follow-up with that prefix
   through proxy B: the follow-up reaches the engine replica that holds the prefix and reports
   the prefix as cached; Redis holds the prefix's block hashes for that replica.
2. Streams through proxy A, some served by node B's replica, while node B dies (SIGKILL of
   every process of its session: raylet, agents, workers, engine processes): every stream
   through A fails over and ends with the text of a fault-free run; a stream through proxy B
   ends at once (its connection drops) rather than hanging; a new request through A succeeds.

Teardown SIGKILLs every process of both nodes' sessions and stops Redis, also after a failure.
Never ``ray stop``: that would kill other Ray instances on a shared machine. Skipped only
without ``redis-server``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench import ray_nodes
from bench.common import free_ports
from bench.ray_nodes import (
    HEALTH_CHECK_ENV,
    RayNode,
    ingress_log_lines,
    kill_all,
    serve_details,
    start_node,
    stop_node,
    wait_for_port,
)
from cluster.app import ROUTING_STATS_PERIOD_S
from cluster.ingress import INGRESS_HEADER, REPLICA_HEADER
from cluster.metrics import METRICS_PUSH_PERIOD_S
from router.protocol import hash_blocks
from tests.router.conftest import REDIS_BINARY, RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.redis]

REPO_ROOT = Path(__file__).resolve().parents[2]
APP_NAME = "twonodes"
BLOCK_SIZE = 16
PREFIX_TOKENS = 20 * BLOCK_SIZE
NUM_PREFIXES = 2
QUESTION_TOKENS = 24
# Token ids of ordinary words in the tiny model's (SmolLM2's) vocabulary.
TOKEN_RANGE = (1000, 40000)
MAX_MODEL_LEN = 1024
# Both nodes, the deployment and the tiny model's replicas on a busy 2-core machine.
STARTUP_TIMEOUT_S = 300.0
# The GCS declares node B dead within this long of the kill.
NODE_DEATH_TIMEOUT_S = 60.0
# Serve's per-worker-node override of the proxy's HTTP port (the head's proxy keeps
# http_options.port), read by the proxy actor from its node's environment.
PROXY_PORT_ENV = "RAY_SERVE_WORKER_PROXY_HTTP_PORT"
# Test 2: streams through proxy A (at least one on each engine replica), each long enough to be
# mid-stream when node B dies.
NUM_STREAMS = 4
STREAM_PROMPT_TOKENS = 40
STREAM_MAX_TOKENS = 400
# Fresh prompts for the fault-free run until routing spread them over both replicas.
PLACEMENT_ATTEMPTS = 3
# A client gives up on a stream that sends nothing for this long: a hang, never a clean end.
STREAM_READ_TIMEOUT_S = 60.0
# A stream through the dead node's proxy ends within this long of the kill.
CLEAN_END_S = 10.0
# What cluster/engine_client.py logs when a stream fails over to another replica.
FAILOVER_LOG = "resuming on another"


def replicas_by_node(details: dict, deployment: str) -> dict[str, str]:
    return ray_nodes.replicas_by_node(details, APP_NAME, deployment)


@dataclass(frozen=True)
class TwoNodes:
    url_a: str
    url_b: str
    redis_url: str
    model_id: str
    node_a: str
    node_b: str
    engines: dict[str, str]
    """{engine replica id: node id}"""
    ingresses: dict[str, str]
    """{ingress replica id: node id}"""
    node_a_process: RayNode
    node_b_process: RayNode


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    if shutil.which(REDIS_BINARY) is None:
        pytest.skip("redis-server binary not found (Debian: apt-get install -y redis-server)")
    import ray
    from ray import serve
    from ray.serve._private import constants as serve_constants

    from cluster import app as app_module
    from worker.testing import make_tiny_model

    assert hasattr(serve_constants, PROXY_PORT_ENV), (
        f"ray {ray.__version__} has no {PROXY_PORT_ENV}: node B's proxy cannot get a port of its "
        "own, and two proxies on one host cannot bind the same one"
    )
    workdir = tmp_path_factory.mktemp("two-nodes")
    model = make_tiny_model(workdir / "tiny", "llama")
    gcs, client_port, dashboard, http_a, http_b = free_ports(5)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    # Loopback-only test cluster: no token auth, no telemetry; the repo on PYTHONPATH so the
    # workers import cluster.app even when prefixserve is not installed.
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    redis_server = RedisServer(str(workdir))
    nodes: list[RayNode] = []
    try:
        redis_server.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        # The head runs its API server even without the dashboard: on a port of its own too.
        head_args = [
            "--head", "--port", str(gcs), "--ray-client-server-port", str(client_port),
            "--include-dashboard", "false", "--dashboard-port", str(dashboard),
        ]  # fmt: skip
        nodes.append(start_node("a", head_args, env, workdir, HEALTH_CHECK_ENV))
        wait_for_port(gcs, nodes[0], deadline)
        # Node B's proxy binds its own port (Serve's per-worker-node knob).
        proxy_port = {PROXY_PORT_ENV: str(http_b)}
        nodes.append(start_node("b", ["--address", f"127.0.0.1:{gcs}"], env, workdir, proxy_port))

        ray.init(address=f"127.0.0.1:{gcs}", log_to_driver=False)
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert nodes[1].process.poll() is None, f"node b failed:\n{nodes[1].log_tail()}"
            assert time.monotonic() < deadline, f"node b did not join: {ray.nodes()}"
            time.sleep(0.2)
        node_ids = ray_nodes.node_ids(["a", "b"])

        serve.start(proxy_location="EveryNode", http_options={"host": "127.0.0.1", "port": http_a})
        engine = {
            "model": model,
            "num_kv_blocks": 256,
            "max_num_seqs": 8,
            "max_model_len": MAX_MODEL_LEN,
            "num_threads": 1,
            "block_size": BLOCK_SIZE,
        }
        cluster = {
            "num_replicas": 2,  # one CPU each, one CPU per node: one on each node
            "num_ingress_replicas": 2,
            "expose_replica_headers": True,  # the tests read who served each request
            "port": http_a,
            "app_name": APP_NAME,
        }
        # 50 ms (the default) is tight for a Python thread on 2 busy cores.
        router = {"index_backend": "redis", "redis_url": redis_server.url,
                  "redis_socket_timeout_s": 0.2}  # fmt: skip
        # One ingress replica per node, so that each proxy hands its requests to the ingress
        # (and router) on its own node: ClusterConfig has no knob for this, and Serve's
        # best-effort spread put both on one node in a trial.
        ingress_options = app_module.ingress_options
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                app_module,
                "ingress_options",
                lambda config: {**ingress_options(config), "max_replicas_per_node": 1},
            )
            app = app_module.build_app({"engine": engine, "cluster": cluster, "router": router})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)

        url_a, url_b = f"http://127.0.0.1:{http_a}", f"http://127.0.0.1:{http_b}"
        details: dict = {}
        while True:  # both proxies answer, with both engine and ingress replicas running
            with contextlib.suppress(httpx.HTTPError):
                healthy = all(
                    httpx.get(f"{url}/health", timeout=5).status_code == 200
                    for url in (url_a, url_b)
                )
                details = serve_details()
                engines = replicas_by_node(details, "EngineReplica")
                ingresses = replicas_by_node(details, "Ingress")
                if healthy and len(engines) == 2 and len(ingresses) == 2:
                    break
            for node in nodes:
                assert node.process.poll() is None, f"node {node.name} died:\n{node.log_tail()}"
            assert time.monotonic() < deadline, f"the app did not come up: {details}"
            time.sleep(0.5)
        model_id = httpx.get(f"{url_a}/v1/models", timeout=10).json()["data"][0]["id"]
        yield TwoNodes(
            url_a, url_b, redis_server.url, model_id, node_ids["a"], node_ids["b"],
            engines, ingresses, nodes[0], nodes[1],
        )  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        for node in reversed(nodes):
            stop_node(node)
        redis_server.stop()


def test_each_node_runs_a_proxy_an_ingress_and_an_engine_replica(two_nodes):
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert alive == {two_nodes.node_a, two_nodes.node_b}
    assert sorted(two_nodes.engines.values()) == sorted([two_nodes.node_a, two_nodes.node_b])
    assert sorted(two_nodes.ingresses.values()) == sorted([two_nodes.node_a, two_nodes.node_b])
    proxies = serve_details()["proxies"]
    assert {node for node, p in proxies.items() if p["status"] == "HEALTHY"} == alive, proxies


def replica_pids(deployment: str) -> dict[str, int]:
    """{replica id: pid} of a deployment's RUNNING replicas."""
    app = serve_details()["applications"][APP_NAME]
    replicas = app["deployments"][deployment]["replicas"]
    return {r["replica_id"]: r["pid"] for r in replicas if r["state"] == "RUNNING"}


def complete(url: str, prompt: list[int], max_tokens: int = 1) -> httpx.Response:
    response = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]


def wait_until_in_redis(redis_url: str, model_id: str, replica: str, prompt: list[int]) -> None:
    """Until Redis holds every full block of ``prompt`` as on ``replica``'s device tier."""
    import redis

    from router.redis_index import namespace

    hashes = hash_blocks(prompt, BLOCK_SIZE, model_id)
    key = f"{namespace(model_id)}dev:{replica}"
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10.0
    try:
        while not all(client.smismember(key, hashes)):
            assert time.monotonic() < deadline, (
                f"Redis never held the prefix for {replica}: {client.keys('prefixserve:*')}"
            )
            time.sleep(0.1)
    finally:
        client.close()


def prefix_decisions(url: str, timeout_s: float = 15.0) -> float:
    """Routing decisions whose reason was ``prefix`` (the winner held the prompt's longest
    cached prefix), summed over both ingress replicas' routers at /metrics, once two reads a
    metrics push period apart agree (the ingress that does not answer reports through the hub
    each second)."""
    from prometheus_client.parser import text_string_to_metric_families

    def count() -> float:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "prefixserve:router_decisions_total"
            and sample.labels.get("reason") == "prefix"
        )

    deadline = time.monotonic() + timeout_s
    previous = count()
    while True:
        time.sleep(METRICS_PUSH_PERIOD_S + 0.3)
        current = count()
        if current == previous or time.monotonic() > deadline:
            return current
        previous = current


def test_requests_through_either_proxy_share_one_prefix_index(two_nodes, test_seed):
    rng = random.Random(test_seed)
    ingress_node = two_nodes.ingresses
    decided_before = prefix_decisions(two_nodes.url_a)
    for _ in range(NUM_PREFIXES):
        prefix = tokens(rng, PREFIX_TOKENS)
        first = complete(two_nodes.url_a, prefix + tokens(rng, QUESTION_TOKENS))
        # Proxy A hands its requests to the ingress replica (and so the router) on node A.
        assert ingress_node[first.headers[INGRESS_HEADER]] == two_nodes.node_a
        engine = first.headers[REPLICA_HEADER]
        wait_until_in_redis(two_nodes.redis_url, two_nodes.model_id, engine, prefix)
        # The routers learn that the first request finished from the replicas' stats.
        time.sleep(ROUTING_STATS_PERIOD_S + 0.3)
        follow_up = complete(two_nodes.url_b, prefix + tokens(rng, QUESTION_TOKENS))
        assert ingress_node[follow_up.headers[INGRESS_HEADER]] == two_nodes.node_b
        assert follow_up.headers[REPLICA_HEADER] == engine
        usage = follow_up.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= PREFIX_TOKENS, usage
    # Node B's router chose that replica for the prefix it found in the index (two routers
    # without a shared index could agree by their cold tie-break, rendezvous hashing): every
    # follow-up, and none of the first requests (their prefixes were new), was a prefix hit.
    assert prefix_decisions(two_nodes.url_a) - decided_before == NUM_PREFIXES


@dataclass
class StreamRecord:
    replica: str | None = None
    text: str = ""
    num_chunks: int = 0
    errors: list = dataclasses.field(default_factory=list)
    done: bool = False
    exception: BaseException | None = None
    start_s: float = 0.0
    ended_s: float | None = None
    """Seconds from ``start_s`` to the stream's end (whatever the end)."""


def stream_completion(url: str, prompt: list[int], record: StreamRecord) -> None:
    body = {"prompt": prompt, "max_tokens": STREAM_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    timeout = httpx.Timeout(STREAM_READ_TIMEOUT_S, connect=10.0)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as reply:
            assert reply.status_code == 200, reply.read()
            record.replica = reply.headers.get(REPLICA_HEADER)
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    record.done = True
                    break
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    record.errors.append(event["error"])
                else:
                    record.text += event["choices"][0]["text"]
                    record.num_chunks += 1
    except Exception as exc:  # noqa: BLE001 - the test judges what the client saw
        record.exception = exc
    record.ended_s = time.monotonic() - record.start_s


def test_losing_the_second_node_keeps_streams_through_the_first(two_nodes, test_seed):
    import ray

    rng = random.Random(test_seed)
    engine_b = next(r for r, node in two_nodes.engines.items() if node == two_nodes.node_b)
    # The fault-free run, its requests at once so that routing spreads them over both
    # replicas; each prompt's stream then follows its cached prefix there.
    for _ in range(PLACEMENT_ATTEMPTS):
        prompts = [tokens(rng, STREAM_PROMPT_TOKENS) for _ in range(NUM_STREAMS)]
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            replies = list(
                pool.map(lambda p: complete(two_nodes.url_a, p, STREAM_MAX_TOKENS), prompts)
            )
        if len({reply.headers[REPLICA_HEADER] for reply in replies}) == 2:
            break
    expected = [reply.json()["choices"][0]["text"] for reply in replies]

    records = [StreamRecord() for _ in range(NUM_STREAMS + 1)]
    targets = [two_nodes.url_a] * NUM_STREAMS + [two_nodes.url_b]
    threads = [
        threading.Thread(target=stream_completion, args=(url, prompt, record), daemon=True)
        for url, prompt, record in zip(targets, [*prompts, prompts[0]], records, strict=True)
    ]
    start = time.monotonic()
    for record in records:
        record.start_s = start
    for thread in threads:
        thread.start()
    while not all(record.num_chunks >= 3 or record.exception for record in records):
        assert time.monotonic() - start < STREAM_READ_TIMEOUT_S, records
        time.sleep(0.01)
    engine_b_pid = replica_pids("EngineReplica")[engine_b]
    node_b_processes = two_nodes.node_b_process.processes()
    chunks_at_kill = [record.num_chunks for record in records]
    ended_at_kill = [record.ended_s is not None for record in records]
    killed_s = time.monotonic() - start
    kill_all(node_b_processes)
    for thread in threads:
        thread.join(timeout=STREAM_READ_TIMEOUT_S + 30.0)
    print(
        f"killed node b {killed_s:.1f}s in, at chunks {chunks_at_kill}; streams ended at "
        f"{[r.ended_s and round(r.ended_s, 1) for r in records]} s; via B: {records[-1]}"
    )
    assert engine_b_pid in {p.pid for p in node_b_processes}  # the kill took node B's replica

    through_a, through_b = records[:NUM_STREAMS], records[NUM_STREAMS]
    on_b = [i for i, record in enumerate(through_a) if record.replica == engine_b]
    assert on_b, f"no stream through A on node B's replica: {[r.replica for r in through_a]}"
    # Node B's replica was mid-stream when it died; the rest of those streams came from A's.
    assert not any(ended_at_kill[i] for i in on_b), (ended_at_kill, chunks_at_kill)
    for record, text in zip(through_a, expected, strict=True):
        assert record.exception is None and not record.errors and record.done, record
        assert record.text == text, record
    # At least one of them was resumed elsewhere. Not necessarily each: a replica that had
    # produced a stream's every output before it died (its end still on the way) ends that
    # stream without a failover (``cluster/engine_client.py``); its text is checked above.
    failovers = ingress_log_lines(two_nodes.node_a_process, FAILOVER_LOG)
    assert failovers, f"node A's ingress logged no failover {FAILOVER_LOG!r}"
    # Through the dead node's proxy: open until the kill, then an end the client sees at once
    # (its connection dropped, or an error event), never a hang.
    assert not ended_at_kill[-1], through_b
    assert through_b.ended_s is not None and through_b.ended_s - killed_s < CLEAN_END_S, through_b
    assert through_b.exception is None or isinstance(through_b.exception, httpx.TransportError)
    assert not isinstance(through_b.exception, httpx.TimeoutException), through_b
    assert not through_b.done or through_b.errors or through_b.text == expected[0], through_b
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{two_nodes.url_b}/health", timeout=5)
    # The GCS declares node B dead; node A serves on.
    deadline = time.monotonic() + NODE_DEATH_TIMEOUT_S
    while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == two_nodes.node_b):
        assert time.monotonic() < deadline, "the GCS never declared node B dead"
        time.sleep(0.5)
    print(f"node b declared dead {time.monotonic() - start - killed_s:.1f}s after the kill")
    reply = complete(two_nodes.url_a, tokens(rng, STREAM_PROMPT_TOKENS), 8)
    assert two_nodes.engines[reply.headers[REPLICA_HEADER]] == two_nodes.node_a
