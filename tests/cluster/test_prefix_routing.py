"""Prefix-aware routing in a real local cluster: more cached tokens than round robin, and an
index that dies costs routing quality, never serving.

One Ray instance (loopback only) serves the module. Each routing policy gets its own application
of 2 tiny-llama replicas; the same shared-prefix workload (5 long system prompts x 3 questions,
sent one at a time, round by round) goes through the OpenAI API and the test sums
``usage.prompt_tokens_details.cached_tokens``; the prefix policy's application also serves two
LoRA adapters, whose requests gather on the replica that loaded each. A third application routes
through a real ``redis-server`` index, which is stopped and started again under it. With 5
prompts alternating over 2 replicas, round robin sends every second request of a prompt to the
replica that has not seen it; prefix routing sends them all to the one that has. Every
application runs 2 ingress replicas (the default with 2 engine replicas), each with its own
router: a prefix first routed by one must reach the same engine replica through the other, since
both read the one index. The ingress also serves CORS and a root_path there.

The first two tests need no Ray: the replica's KV stream re-announces what it holds to an index
that lost it, and the router metrics of a process render as Prometheus series.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from bench.common import free_port
from cluster.app import ROUTING_STATS_PERIOD_S
from cluster.ingress import INGRESS_HEADER, REPLICA_HEADER
from cluster.kv_publisher import ReplicaKVPublisher
from router.embedded_index import EmbeddedIndex
from router.index_types import IndexUnavailableError
from router.liveness import ApplyOutcome
from router.protocol import EventKind, KVEvent, KVEventBatch, Tier, hash_blocks
from tests.cluster.conftest import STARTUP_TIMEOUT_S

BLOCK_SIZE = 16
NUM_SYSTEM_PROMPTS = 5  # odd, so round robin alternates each prompt between the 2 replicas
NUM_QUESTIONS = 3
SYSTEM_TOKENS = 20 * BLOCK_SIZE
QUESTION_TOKENS = 24
# A user's think time between requests, longer than the replicas' routing-stats period.
# With two ingress replicas, the router that did not send the previous request learns that it
# finished only from those stats; until then that request costs a decode step (20 ms) in the
# predicted TTFT, more than the tiny model takes to prefill a whole system prompt, so the
# policy would rightly send the repeat elsewhere.
THINK_TIME_S = ROUTING_STATS_PERIOD_S + 0.3
# Between one adapter's requests: a stats period more. The tiny model loads an adapter in
# milliseconds, so its holder wins only while no router still prices the previous request
# on it (a 20 ms decode step); a router that gets the next stats more than 0.3 s late (two
# busy CI cores) would rightly send the request to the replica that loads the adapter.
ADAPTER_THINK_TIME_S = 2 * ROUTING_STATS_PERIOD_S + 0.3
# Token ids of ordinary words in the SmolLM2 vocabulary (clear of the special tokens).
TOKEN_RANGE = (1000, 40000)
# Two ingress replicas: rounds of the workload until this many system prompts were routed
# by both (the proxy picks an ingress at random), at most MAX_INGRESS_ROUNDS rounds.
NUM_CROSSED_PROMPTS = 4
MAX_INGRESS_ROUNDS = 8
CORS_ORIGIN = "http://app.example"
ROOT_PATH = "/llm"


# ------------------------------------------------------------------------ no Ray needed
def _batch(seq: int, *events: KVEvent) -> KVEventBatch:
    return KVEventBatch("engine", seq, tuple(events))


def test_replica_stream_reannounces_what_it_holds_to_an_index_that_lost_it():
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    pending = [
        _batch(0, KVEvent(EventKind.STORED, (a, b))),
        _batch(1, KVEvent(EventKind.STORED, (c,), Tier.HOST)),
    ]

    def drain():
        out = list(pending)
        pending.clear()
        return out

    first = EmbeddedIndex()
    publisher = ReplicaKVPublisher(drain, first, "r1", 10.0, 1.0, epoch=7)
    sent = publisher.drain_once()
    assert [batch.seq for batch in sent] == [0, 1, 2]  # renumbered, then the opening announce
    assert sent[-1].events[0].kind == EventKind.CLEARED
    assert all(batch.replica_epoch == 7 for batch in sent)
    publisher.publisher.run_once()
    assert first.match([a, b, c])["r1"].device_blocks == 2
    assert first.match([a, b, c])["r1"].host_blocks == 1

    # The index restarts empty; the next batch it sees is out of the blue, so it asks for a
    # re-announce, which rebuilds the full view (the removal of b included).
    second = EmbeddedIndex()
    publisher.index.inner = second
    pending.append(_batch(2, KVEvent(EventKind.REMOVED, (b,))))
    publisher.drain_once()
    assert publisher.publisher.run_once() == [ApplyOutcome.STALE]
    assert second.match([a, b]) == {}
    publisher.drain_once()
    assert publisher.publisher.run_once() == [ApplyOutcome.APPLIED]
    assert second.match([a])["r1"].device_blocks == 1
    assert second.match([a, b]).get("r1").num_blocks == 1
    assert second.match([c])["r1"].host_blocks == 1


def test_an_idle_replica_drains_once_a_second_and_a_busy_one_ten_times():
    from cluster.kv_publisher import DRAIN_PERIOD_S, IDLE_DRAIN_PERIOD_S, next_drain_period_s

    assert (IDLE_DRAIN_PERIOD_S, DRAIN_PERIOD_S) == (1.0, 0.1)
    period_s, waits = DRAIN_PERIOD_S, []
    for _ in range(8):  # nothing to drain: the wait doubles up to the idle period
        period_s = next_drain_period_s(period_s, found=False)
        waits.append(period_s)
    assert waits[:2] == [2 * DRAIN_PERIOD_S, 4 * DRAIN_PERIOD_S]
    assert waits[-1] == IDLE_DRAIN_PERIOD_S == max(waits)
    assert next_drain_period_s(period_s, found=True) == DRAIN_PERIOD_S


def test_router_metrics_of_a_process_sum_up_and_render_for_prometheus():
    from cluster.metrics_render import render_prometheus
    from router.metrics import RouterMetrics, merge_snapshots

    first, second = RouterMetrics(), RouterMetrics()
    first.record_decision("prefix", "prefix", 10, 8)
    first.record_lookup(0.3)
    second.record_decision("prefix", "fallback", 10, 0)
    second.record_decision("prefix", "prefix", 20, 20)
    second.record_lookup(3.0)
    merged = merge_snapshots(merge_snapshots({}, first.snapshot()), second.snapshot())
    assert merged["matched_block_ratio"] == 28 / 40
    assert merged["num_fallback_decisions"] == 1
    assert merged["lookup_latency_ms"]["count"] == 2
    text = render_prometheus({}, merged).decode()
    assert 'prefixserve:router_decisions_total{policy="prefix",reason="prefix"} 2.0' in text
    assert "prefixserve:router_fallback_decisions_total 1.0" in text
    assert "prefixserve:router_lookup_latency_seconds_count 2.0" in text


# ----------------------------------------------------------------- the real cluster


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    import ray
    from ray import serve

    from worker.testing import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")
    port = free_port()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield model, port
    serve.shutdown()
    ray.shutdown()


def _start_app(
    model: str,
    port: int,
    policy: str,
    redis_url: str | None = None,
    lora_modules: dict[str, str] | None = None,
) -> str:
    from ray import serve

    from cluster.app import build_app

    name = f"routing-{policy}" if redis_url is None else "routing-redis"
    router = {"policy": policy}
    if redis_url is not None:
        # 50 ms (the default) is tight for a Python thread on 2 busy CI cores.
        router.update(index_backend="redis", redis_url=redis_url, redis_socket_timeout_s=0.2)
    engine = {
        "model": model,
        "num_kv_blocks": 256,
        "max_num_seqs": 8,
        "max_model_len": 1024,
        "num_threads": 1,
        "block_size": BLOCK_SIZE,
    }
    if lora_modules:
        engine["lora_modules"] = lora_modules
    cluster = {
        "num_replicas": 2,  # and so 2 ingress replicas
        "expose_replica_headers": True,  # the tests read who served each request
        "port": port,
        "app_name": name,
        "allowed_origins": [CORS_ORIGIN],
        "root_path": ROOT_PATH,
    }
    app = build_app({"engine": engine, "cluster": cluster, "router": router})
    for other in serve.status().applications:  # one application on "/" at a time
        serve.delete(other)
    serve.run(app, name=name, route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"application {name} did not become healthy in time")


def _workload(seed: int) -> list[list[int]]:
    """Prompts round by round: every system prompt's first question, then the second..."""
    rng = random.Random(seed)
    systems = [
        [rng.randrange(*TOKEN_RANGE) for _ in range(SYSTEM_TOKENS)]
        for _ in range(NUM_SYSTEM_PROMPTS)
    ]
    return [
        system + [rng.randrange(*TOKEN_RANGE) for _ in range(QUESTION_TOKENS)]
        for _ in range(NUM_QUESTIONS)
        for system in systems
    ]


def _complete(url: str, prompt: list[int]) -> httpx.Response:
    response = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response


def _cached_tokens(url: str, prompts: list[list[int]], think_time_s: float = THINK_TIME_S) -> int:
    num_cached_tokens = 0
    for prompt in prompts:
        usage = _complete(url, prompt).json()["usage"]
        num_cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
        time.sleep(think_time_s)
    return num_cached_tokens


@pytest.fixture(scope="module")
def adapters(ray_cluster, tmp_path_factory) -> dict[str, str]:
    """Two random LoRA adapters of the tiny model (``sql`` and ``chat``), which the prefix
    policy's application serves."""
    from worker.testing import write_random_adapter

    model, _ = ray_cluster
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: write_random_adapter(model, folder / name, rank=8, seed=seed)
        for seed, name in enumerate(("sql", "chat"))
    }


@pytest.fixture(scope="module")
def cached_by_policy(ray_cluster, adapters) -> dict[str, int]:
    """Cached prompt tokens of the same workload under each policy (fresh replicas each).
    Round robin reads no load, so its requests need no think time between them; the prefix
    policy's application stays up for the tests that follow (and serves the adapters)."""
    model, port = ray_cluster
    url = _start_app(model, port, "round_robin")
    results = {"round_robin": _cached_tokens(url, _workload(seed=1), think_time_s=0.0)}
    url = _start_app(model, port, "prefix", lora_modules=adapters)
    results["prefix"] = _cached_tokens(url, _workload(seed=1))
    print(f"cached tokens by policy: {results}")
    return results


@pytest.mark.slow
def test_prefix_routing_caches_nearly_every_repeat_and_no_less_than_round_robin(cached_by_policy):
    # Every repeat of a system prompt can hit all of its blocks: 5 prompts x 2 repeats.
    # Round robin alternates per ingress replica, and the proxy picks one of the two at random,
    # so its share of hits varies from run to run (half the ideal with one ingress, 1600-2240
    # tokens seen with two); prefix routing must reach nearly all of them, whatever the proxy
    # picks (round robin rarely gets there: 2 of 10 repeats missed already fail the bar).
    ideal = NUM_SYSTEM_PROMPTS * (NUM_QUESTIONS - 1) * SYSTEM_TOKENS
    assert cached_by_policy["prefix"] >= 0.9 * ideal, cached_by_policy
    assert cached_by_policy["prefix"] >= cached_by_policy["round_robin"], cached_by_policy


def _settled_counts(url: str, timeout_s: float = 15.0) -> tuple[float, float]:
    """(finished requests, routing decisions) at /metrics, once two reads a push period apart
    agree (the ingress that does not answer reports through the metrics hub each second)."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> tuple[float, float]:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        totals = {
            "prefixserve:request_success_total": 0.0,
            "prefixserve:router_decisions_total": 0.0,
        }
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        return tuple(totals.values())

    deadline = time.monotonic() + timeout_s
    previous = counts()
    while True:
        time.sleep(1.3)
        current = counts()
        if current == previous or time.monotonic() > deadline:
            return current
        previous = current


@pytest.mark.slow
def test_two_ingress_replicas_send_a_prefix_to_the_same_engine_replica(
    ray_cluster, cached_by_policy
):
    """Each ingress replica routes with its own router (own in-flight counts and load
    window); a prefix first routed through one reaches the same engine replica through the
    other, because both look it up in the one IndexActor of the application."""
    url = f"http://127.0.0.1:{ray_cluster[1]}"
    rng = random.Random(7)
    systems = [system[:SYSTEM_TOKENS] for system in _workload(seed=5)[:NUM_SYSTEM_PROMPTS]]
    first: dict[int, tuple[str, str]] = {}  # system -> (ingress, engine) of its first request
    crossed: list[tuple[int, str, str]] = []  # (system, first engine, engine via the other)
    ingresses = set()
    served_before, decided_before = _settled_counts(url)
    num_requests = 0
    for _ in range(MAX_INGRESS_ROUNDS):
        for index, system in enumerate(systems):
            question = [rng.randrange(*TOKEN_RANGE) for _ in range(QUESTION_TOKENS)]
            reply = _complete(url, system + question)
            num_requests += 1
            ingress, engine = reply.headers[INGRESS_HEADER], reply.headers[REPLICA_HEADER]
            ingresses.add(ingress)
            if index not in first:
                first[index] = (ingress, engine)
            elif ingress != first[index][0]:
                crossed.append((index, first[index][1], engine))
            time.sleep(THINK_TIME_S)
        if len({index for index, _, _ in crossed}) >= NUM_CROSSED_PROMPTS:
            break
    # /metrics, whichever ingress answers, counts the requests and decisions of both.
    served, decided = _settled_counts(url)
    assert (served - served_before, decided - decided_before) == (num_requests, num_requests)
    assert len(ingresses) == 2, ingresses
    assert len({index for index, _, _ in crossed}) >= NUM_CROSSED_PROMPTS, (first, crossed)
    # Two views of the prefixes would agree by chance about half the time.
    assert all(first_engine == engine for _, first_engine, engine in crossed), (first, crossed)


@pytest.mark.slow
def test_an_adapters_requests_gather_on_the_replica_that_holds_it(
    ray_cluster, adapters, cached_by_policy
):
    """Two LoRA adapters on 2 replicas, prompts that share no block: once an adapter's first
    request has loaded it on one replica, the prefix policy sends its later requests there,
    through either ingress replica (the other replica would pay the adapter's load first)."""
    url = f"http://127.0.0.1:{ray_cluster[1]}"
    rng = random.Random(3)
    served: dict[str, list[str]] = {name: [] for name in adapters}
    for _ in range(4):
        for name in adapters:
            prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(QUESTION_TOKENS)]
            response = httpx.post(
                f"{url}/v1/completions",
                json={"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            served[name].append(response.headers[REPLICA_HEADER])
            time.sleep(ADAPTER_THINK_TIME_S)
    for name, replicas in served.items():
        assert set(replicas) == {replicas[0]}, (name, replicas)


@pytest.mark.slow
def test_the_routers_share_their_in_flight_requests_through_the_index_actor(
    ray_cluster, cached_by_policy
):
    """Requests in flight show on the application's in-flight board (what the two ingress
    replicas' routers read of each other, ``cluster.inflight_board``) and leave it once done."""
    import concurrent.futures

    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    from cluster.index_actor import index_actor_name
    from router.load import LoadSnapshot

    url = f"http://127.0.0.1:{ray_cluster[1]}"
    actor = ray.get_actor(index_actor_name("routing-prefix"), namespace=SERVE_NAMESPACE)
    prompts = [p[:64] for p in _workload(seed=3)[:6]]

    def generate(prompt):
        response = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True},
            timeout=120,
        )
        assert response.status_code == 200, response.text

    # The observer reports too, as a router would: a router that sees no other one on the
    # board publishes only its refreshes (cluster.inflight_board).
    ray.get(actor.report_inflight.remote("an-observer", 1, LoadSnapshot(), 120.0))
    most_seen = 0
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, prompt) for prompt in prompts]
        while not all(f.done() for f in futures):
            board = ray.get(actor.peer_inflight.remote("an-observer"))
            most_seen = max(most_seen, board.num_in_flight)
            time.sleep(0.02)
        for future in futures:
            future.result()
    assert most_seen >= 2, most_seen
    deadline = time.monotonic() + 10.0
    while ray.get(actor.peer_inflight.remote("an-observer")).num_in_flight:
        assert time.monotonic() < deadline, "finished requests stayed in flight on the board"
        time.sleep(0.1)


@pytest.mark.slow
def test_ingress_answers_cors_and_serves_under_its_root_path(ray_cluster, cached_by_policy):
    url = f"http://127.0.0.1:{ray_cluster[1]}"
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    allowed = httpx.options(f"{url}/v1/completions", headers={"Origin": CORS_ORIGIN, **preflight})
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == CORS_ORIGIN
    other = httpx.options(
        f"{url}/v1/completions", headers={"Origin": "http://other.example", **preflight}
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # Behind a proxy that keeps the prefix, and one that strips it.
    for path in (f"{ROOT_PATH}/v1/models", "/v1/models"):
        models = httpx.get(f"{url}{path}", headers={"Origin": CORS_ORIGIN}, timeout=10)
        assert models.status_code == 200, (path, models.text)
        assert models.headers["access-control-allow-origin"] == CORS_ORIGIN
    reply = httpx.post(f"{url}{ROOT_PATH}/v1/completions", headers={"Origin": CORS_ORIGIN},
                       json={"prompt": "Hello", "max_tokens": 1}, timeout=60)  # fmt: skip
    assert reply.status_code == 200, reply.text
    exposed = reply.headers["access-control-expose-headers"].lower()
    assert REPLICA_HEADER in exposed and INGRESS_HEADER in exposed  # browsers may read them


@pytest.mark.slow
def test_dead_index_still_serves_and_the_index_comes_back(ray_cluster, cached_by_policy):
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    from cluster.index_actor import index_actor_name

    url = f"http://127.0.0.1:{ray_cluster[1]}"
    name = index_actor_name("routing-prefix")
    ray.kill(ray.get_actor(name, namespace=SERVE_NAMESPACE), no_restart=True)
    prompts = _workload(seed=2)[:NUM_SYSTEM_PROMPTS]
    served_by = {}
    for prompt in prompts:  # no index: every request is still served (by load)
        served_by[tuple(prompt)] = _complete(url, prompt).headers["x-prefixserve-replica"]

    # The replicas' publishers re-create the index and re-announce what they hold.
    model_id = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    deadline = time.monotonic() + 60.0
    while True:
        try:
            index = ray.get_actor(name, namespace=SERVE_NAMESPACE)
            found = {
                key: ray.get(index.match.remote(hash_blocks(list(key), BLOCK_SIZE, model_id)))
                for key in served_by
            }
            known = ray.get(index.replicas.remote())
            if len(known) == 2 and all(served_by[key] in found[key] for key in served_by):
                break
        except (ValueError, ray.exceptions.RayActorError):
            pass
        assert time.monotonic() < deadline, "the index did not relearn the replicas' blocks"
        time.sleep(0.5)


def _wait_until_indexed(index, served_by: dict[tuple, str], model_id: str) -> None:
    """Until the index knows both replicas and which one holds each served prompt."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            held = {
                key: index.match(hash_blocks(list(key), BLOCK_SIZE, model_id)) for key in served_by
            }
            if len(index.replicas()) == 2 and all(served_by[k] in held[k] for k in served_by):
                return
        except IndexUnavailableError:
            pass
        assert time.monotonic() < deadline, "the index did not relearn the replicas' blocks"
        time.sleep(0.5)


@pytest.mark.slow
def test_redis_index_routes_and_relearns_after_redis_restarts(ray_cluster, tmp_path):
    from ray import serve

    from router.redis_index import RedisIndex
    from tests.router.conftest import RedisServer

    model, port = ray_cluster
    redis_server = RedisServer(str(tmp_path))
    redis_server.start()
    try:
        url = _start_app(model, port, "prefix", redis_url=redis_server.url)
        cached = _cached_tokens(url, _workload(seed=3))
        print(f"cached tokens with prefix over redis: {cached}")
        assert cached >= 0.8 * NUM_SYSTEM_PROMPTS * (NUM_QUESTIONS - 1) * SYSTEM_TOKENS

        model_id = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        index = RedisIndex(redis_server.url, model_id, socket_timeout_s=1.0)
        redis_server.stop()  # Redis down: routing by load, serving as usual
        served_by = {}
        for prompt in _workload(seed=4)[:NUM_SYSTEM_PROMPTS]:
            served_by[tuple(prompt)] = _complete(url, prompt).headers["x-prefixserve-replica"]
        redis_server.start()  # back, empty: the replicas re-announce what they hold
        _wait_until_indexed(index, served_by, model_id)
        serve.delete("routing-redis")
    finally:
        redis_server.stop()
