"""A tensor-parallel replica (TP = 2, tiny model) whose worker actor is killed: the in-flight
stream ends with an error, the replica reports itself unhealthy within the health-check
period, Ray Serve replaces it, and the cluster serves again."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cluster.app import HEALTH_CHECK_PERIOD_S
from cluster.ingress import REPLICA_HEADER
from cluster.metrics import METRICS_PUSH_PERIOD_S
from cluster.tp_workers import WORKER_NAME_PREFIX
from tests.cluster.conftest import STARTUP_TIMEOUT_S, start_cluster

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog."
# The engine learns of the dead rank at its next step (gloo sees the closed connection) or
# from the launcher; /health follows on the next metrics push. Slack for a loaded CI machine.
UNHEALTHY_WITHIN_S = HEALTH_CHECK_PERIOD_S + 2 * METRICS_PUSH_PERIOD_S + 5.0


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    from worker.testing import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tp-tiny") / "llama", "llama")
    engine = {
        "model": model,
        "num_kv_blocks": 256,
        "max_model_len": 1024,
        "num_threads": 1,
        "tensor_parallel_size": 2,
    }
    url, teardown = start_cluster(engine, {"num_replicas": 1, "expose_replica_headers": True}, "tp")
    yield url
    teardown()


def complete(url: str, max_tokens: int = 4) -> httpx.Response:
    response = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": "llama", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0},
    )
    return response


def tp_workers() -> list[tuple[str, str]]:
    import ray

    return [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(WORKER_NAME_PREFIX)
    ]


def wait_for(predicate, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what} did not happen within {timeout_s:.0f}s")
        time.sleep(0.2)
    return time.monotonic() - started


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_killed_worker_fails_the_replica_and_serve_replaces_it(tp_server):
    import ray

    url = tp_server
    first = complete(url)
    assert first.status_code == 200, first.text
    old_replica = first.headers[REPLICA_HEADER]
    (worker,) = tp_workers()
    assert old_replica in worker[0], "worker actors are named after their replica"

    stream_lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {
            "model": "llama",
            "prompt": PROMPT,
            "max_tokens": 1000,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                stream_lines.append(line)
                started.set()
        started.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(60), "the long request never started streaming"
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(worker[0], namespace=worker[1]), no_restart=True)

    reader.join(30)
    assert not reader.is_alive(), "the in-flight stream hung after its worker died"
    errors = [line for line in stream_lines if '"error"' in line]
    assert errors, f"the in-flight stream ended without an error: {stream_lines[-3:]}"
    assert "rank" in json.loads(errors[0].removeprefix("data: "))["error"]["message"]

    wait_for(
        lambda: health(url) != 200,
        UNHEALTHY_WITHIN_S - (time.monotonic() - killed_at),
        "/health failing",
    )
    wait_for(
        lambda: health(url) == 200, STARTUP_TIMEOUT_S, "a replacement replica becoming healthy"
    )
    again = complete(url)
    assert again.status_code == 200, again.text
    assert again.headers[REPLICA_HEADER] != old_replica, "Serve was meant to replace the replica"
    assert len(tp_workers()) == 1 and tp_workers()[0][0] != worker[0]
