"""KV pulls through a real Serve application: what the Ray-free tests stand in for.

One Ray instance (loopback), one application of 2 tiny-llama replicas with pulls on, called
through a ``DeploymentHandle`` of the driver (whose request router is ours): the router's
order travels to the replica in the call's keywords (``serve_compat.set_request_kwarg``), the
replica reaches its peer's actor by name (``serve_compat.peer_replica``), the follow-up
request is answered as a hit with the tokens of the cold run, and ``/metrics`` counts the pull.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from bench.common import free_port
from cluster.app import ROUTING_STATS_PERIOD_S
from router.protocol import hash_blocks
from tests.cluster.conftest import STARTUP_TIMEOUT_S, Server
from worker.outputs import OutputDelta
from worker.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

APP = "kvpull"
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# Keeps the holder busy while the follow-up is routed: decoding this many tokens outlasts it.
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from ray import serve

    from cluster.app import build_app
    from worker.testing import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("kvpull") / "tiny-llama", "llama")
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = {"model": model, "num_kv_blocks": 256, "max_model_len": 1024, "num_threads": 1}
        cluster = {"num_replicas": 2, "num_ingress_replicas": 1, "port": port, "app_name": APP}
        router = {"kv_pull_tokens_per_s": 1e6}  # pulls all but free: an idle puller wins
        app = build_app({"engine": engine, "cluster": cluster, "router": router})
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the cluster did not become healthy in time"
            time.sleep(0.5)
        yield Server(url, "", model, 1024, 0), serve.get_deployment_handle("EngineReplica", APP)
    finally:
        serve.shutdown()
        ray.shutdown()


async def generate(handle, request_id, prompt, hashes, params, first_only=False):
    """(replica id, cached tokens, token ids) of one ``generate`` call through the handle."""
    stream = handle.options(stream=True).generate.remote(
        request_id, prompt, params, cache_salt=None, block_hashes=hashes
    )
    replica_id, cached, tokens = None, 0, []
    async for item in stream:
        assert isinstance(item, OutputDelta), item
        replica_id, cached = item.replica_id, item.num_cached_tokens
        tokens += [t for c in item.choices for t in c.new_token_ids]
        if first_only:
            return replica_id, cached, tokens, stream
    return replica_id, cached, tokens, None


async def warm_up(handle, rng, described, max_requests=8):
    """Cold prompts until both replicas served one, so both report measured prefill rates (an
    unmeasured replica is priced at the default rate, which may differ from the tiny model's
    by far more than a pull costs). Then long enough for their stats to show them idle."""
    import asyncio

    served = set()
    for i in range(max_requests):
        prompt = [rng.randrange(1000, 40000) for _ in range(40)]
        hashes = hash_blocks(prompt, described["block_size"], described["model_id"], None)
        served.add((await generate(handle, f"warm{i}", prompt, hashes, PARAMS))[0])
        if len(served) == 2:
            break
    assert len(served) == 2, "the router never sent a cold prompt to the second replica"
    await asyncio.sleep(2 * ROUTING_STATS_PERIOD_S + 0.5)


@pytest.mark.timeout(300)
def test_a_busy_holders_prefix_is_pulled_by_the_idle_replica_through_serve(cluster, test_seed):
    import asyncio

    server, handle = cluster
    rng = random.Random(test_seed)
    prompt = [rng.randrange(1000, 40000) for _ in range(100)]  # 6 full blocks

    async def main():
        described = await handle.describe.remote()
        await warm_up(handle, rng, described)
        hashes = hash_blocks(prompt, described["block_size"], described["model_id"], None)
        holder, cached, cold, _ = await generate(handle, "cold", prompt, hashes, PARAMS)
        assert cached == 0 and len(cold) == PARAMS.max_tokens
        # The holder's KV events reach the index, and its routing stats no longer show the
        # cold request running (else the next request is priced as queued behind it).
        await asyncio.sleep(2 * ROUTING_STATS_PERIOD_S + 0.5)
        # The holder gets a long request for the prefix, then the follow-up goes elsewhere.
        busy, _, _, long_stream = await generate(
            handle, "long", prompt, hashes, LONG, first_only=True
        )
        assert busy == holder
        puller, cached, tokens, _ = await generate(handle, "follow", prompt, hashes, PARAMS)
        long_stream.cancel()
        assert puller != holder, "an idle replica that can pull beats the busy holder"
        assert cached == 96, "the pulled prefix is reported as cached"
        assert tokens == cold, "tokens bitwise equal to the holder's cold run"
        return puller

    puller = asyncio.run(main())
    deadline = time.monotonic() + 10.0
    while True:  # the replicas push their metrics every second
        metrics = server.metrics()
        if metrics.get("prefixserve:kv_pulls_total", {}).get(puller) == 1.0:
            break
        assert time.monotonic() < deadline, metrics.get("prefixserve:kv_pulls_total")
        time.sleep(0.5)
    assert metrics["prefixserve:kv_pull_blocks_total"][puller] == 6.0
    assert metrics["prefixserve:kv_pull_failures_total"][puller] == 0.0
