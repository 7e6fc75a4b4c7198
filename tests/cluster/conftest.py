"""A real local cluster for the Serve tests: Ray, Serve, the app, on a free loopback port."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import httpx

from bench.common import free_port
from bench.serve.systems import replicas_in_metrics

API_KEY = "test-key-" + os.urandom(4).hex()
# Replica startup on a loaded 2-core CI machine: model load plus Serve's health checks.
STARTUP_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Server:
    url: str
    api_key: str
    model: str
    max_model_len: int
    max_request_body_bytes: int
    lora_modules: dict[str, str] = field(default_factory=dict)
    """The LoRA adapters served from the start (name -> folder)."""

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def metrics(self) -> dict[str, dict[str, float]]:
        """{series name: {key: value}} for the samples of /metrics other than buckets; the key
        is the ``replica`` label for an engine replica's series, else the labels other than
        ``model_name`` as ``k=v,...`` (``""`` for an ingress or router series without any)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith(("_bucket", "_created")):
                    continue
                labels = sample.labels
                key = labels.get("replica") or ",".join(
                    f"{k}={v}" for k, v in sorted(labels.items()) if k != "model_name"
                )
                values.setdefault(sample.name, {})[key] = float(sample.value)
        return values


def wait_for_replica_series(url: str, num_replicas: int, timeout_s: float) -> None:
    """Waits until ``/metrics`` has the series of exactly ``num_replicas`` engine replicas
    (after a replica was replaced: the new one pushed, the dead one's went stale)."""
    deadline = time.monotonic() + timeout_s
    while (found := replicas_in_metrics(url)) != num_replicas:
        if time.monotonic() > deadline:
            raise AssertionError(f"/metrics shows {found} replicas, not {num_replicas}")
        time.sleep(0.5)


def start_cluster(engine: dict, cluster: dict, app_name: str):
    """Starts Ray + Serve + the app; returns (url, teardown) once every engine replica serves
    (``/health`` answers once any does; each replica's series in ``/metrics`` says it does)."""
    import ray
    from ray import serve

    from cluster.app import build_app

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({"engine": engine, "cluster": {**cluster, "port": port, "app_name": app_name}})
    serve.run(app, name=app_name, route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    num_replicas = cluster.get("num_replicas", 1)
    while time.monotonic() < deadline:
        try:
            if (
                httpx.get(f"{url}/health", timeout=5).status_code == 200
                and replicas_in_metrics(url) >= num_replicas
            ):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        serve.shutdown()
        ray.shutdown()
        raise RuntimeError("the cluster did not become healthy in time")

    def teardown() -> None:
        serve.shutdown()
        ray.shutdown()

    return url, teardown


TINY_MAX_MODEL_LEN = 1024
TINY_MAX_BODY_BYTES = 64 * 1024
# Set to "URL API_KEY MODEL" to run the tests against a tiny cluster already running (started
# with ``python tests/cluster/conftest.py``) while developing, instead of starting one.
REUSE_ENV = "PREFIXSERVE_TEST_TINY_SERVER"


def start_tiny_cluster(folder, lora: bool = False) -> tuple[Server, object]:
    """Two replicas of a tiny random llama; API key on; small limits to exercise them; tool
    calling with ``auto`` allowed (hermes format); with ``lora``, two LoRA adapters of it
    (``sql`` and ``chat``) served from the start."""
    from pathlib import Path

    from worker.testing import make_tiny_adapter, make_tiny_model

    model = make_tiny_model(folder, "llama")
    lora_modules = {}
    if lora:
        parent = Path(folder).parent
        for seed, name in enumerate(("sql", "chat"), start=1):
            lora_modules[name] = make_tiny_adapter(model, parent / f"lora-{name}", seed=seed)
    engine = {
        "model": model,
        "num_kv_blocks": 512,
        "max_num_seqs": 16,
        "max_model_len": TINY_MAX_MODEL_LEN,
        "num_threads": 1,
        "lora_modules": lora_modules,
    }
    cluster = {
        "num_replicas": 2,
        "expose_replica_headers": True,  # the tests read who served each request
        "api_key": API_KEY,
        "max_ongoing_requests": 24,
        "max_queued_requests": 64,
        "max_request_body_bytes": TINY_MAX_BODY_BYTES,
        "enable_auto_tool_choice": True,
        "tool_call_parser": "hermes",
    }
    url, teardown = start_cluster(engine, cluster, "tiny")
    server = Server(url, API_KEY, model, TINY_MAX_MODEL_LEN, TINY_MAX_BODY_BYTES, lora_modules)
    return server, teardown


if __name__ == "__main__":
    import signal
    import tempfile

    server, teardown = start_tiny_cluster(tempfile.mkdtemp() + "/tiny-llama")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    print(f"{REUSE_ENV}='{server.url} {server.api_key} {server.model}'", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        teardown()
