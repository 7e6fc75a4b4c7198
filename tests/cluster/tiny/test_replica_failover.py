"""Stream failover: an engine replica killed mid-stream, and the client cannot tell.

The ingress re-submits the cut stream to the other replica with the tokens already sent
(``cluster/engine_client.py``); greedy decoding is deterministic, so the client's one stream
must hold exactly the text of a fault-free run, end normally and count usage as if nothing
happened. The test then waits for Serve to replace the replica, so the package's other
modules find the two replicas they expect.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.cluster.conftest import wait_for_replica_series

MAX_TOKENS = 300
PROMPT = "Failover check: keep counting " + " ".join(str(i) for i in range(40))
# Serve's replacement of a killed replica on a loaded 2-core machine (model load included).
REPLACEMENT_TIMEOUT_S = 180.0


def stream_completion(server, *, on_chunk=None) -> tuple[str, list[dict], str]:
    """(text, every SSE event, serving replica) of one streamed greedy completion."""
    body = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[dict] = []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120
    ) as reply:
        assert reply.status_code == 200, reply.read()
        replica = reply.headers["x-prefixserve-replica"]
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if on_chunk is not None:
                on_chunk(len(events), replica)
    text = "".join(c["text"] for e in events for c in e.get("choices", ()))
    return text, events, replica


def kill_replica(replica_id: str) -> None:
    import ray

    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "EngineReplica" in a["name"] and a["name"].endswith(replica_id)
    ]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)


def wait_for_two_replicas() -> None:
    from ray import serve

    deadline = time.monotonic() + REPLACEMENT_TIMEOUT_S
    while time.monotonic() < deadline:
        apps = serve.status().applications.values()
        running = [
            d.replica_states.get("RUNNING", 0)
            for app in apps
            for name, d in app.deployments.items()
            if name == "EngineReplica"
        ]
        if running and all(n == 2 for n in running) and all(a.status == "RUNNING" for a in apps):
            return
        time.sleep(1.0)
    raise AssertionError(f"Serve did not replace the killed replica: {serve.status()}")


@pytest.mark.slow
def test_a_stream_survives_its_replica_being_killed(tiny_server):
    import os

    from tests.cluster.conftest import REUSE_ENV

    if os.environ.get(REUSE_ENV):
        pytest.skip("kills a replica of the cluster this process started")
    expected, events, _ = stream_completion(tiny_server)
    expected_usage = events[-1]["usage"]
    assert expected_usage["completion_tokens"] == MAX_TOKENS

    killed: list[str] = []

    def kill_after_some_tokens(num_events: int, replica: str) -> None:
        if num_events == 20 and not killed:
            kill_replica(replica)
            killed.append(replica)

    try:
        text, events, replica = stream_completion(tiny_server, on_chunk=kill_after_some_tokens)
        assert killed == [replica], "the stream ended before the kill"
        assert not [e for e in events if "error" in e], events
        assert text == expected
        finishes = [
            c["finish_reason"] for e in events for c in e.get("choices", ()) if c["finish_reason"]
        ]
        assert finishes == ["length"]
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert usage["prompt_tokens"] == expected_usage["prompt_tokens"]
    finally:
        wait_for_two_replicas()
        # the package's other tests count one metric series per replica
        wait_for_replica_series(tiny_server.url, 2, REPLACEMENT_TIMEOUT_S)
