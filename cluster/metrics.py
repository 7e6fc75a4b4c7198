"""Prometheus metrics of every engine replica, under vLLM's names with the prefix ``prefixserve:``.

Each replica keeps its own latency histograms (``ReplicaMetrics``) next to its engine's
counters and gauges (``AsyncEngine.metrics()``) and pushes a snapshot every
``METRICS_PUSH_PERIOD_S`` to one ``MetricsHub`` deployment of the application. The ingress
reads the hub for ``/metrics`` (rendered by ``render_prometheus``, labelled by ``model_name``
and ``replica``) and for ``/health``. A replica that stops reporting drops out after
``STALE_AFTER_S``; a hub that is down costs metrics and health, never serving.
"""

from __future__ import annotations

import bisect
import time

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import generate_latest
from ray import serve

PREFIX = "prefixserve:"
# Often enough that /health notices a dead engine within seconds, rarely enough to cost nothing.
METRICS_PUSH_PERIOD_S = 1.0
# Three missed pushes: the replica is gone (or hung) and no longer counts as serving.
STALE_AFTER_S = 3 * METRICS_PUSH_PERIOD_S + 2.0

# vLLM's buckets, so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

GAUGES = {
    "num_requests_running": "Requests holding KV blocks in the engine.",
    "num_requests_waiting": "Requests waiting for admission.",
    "kv_cache_usage_perc": "Fraction of KV blocks in use, in [0, 1].",
}
COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "prompt_tokens": "Prompt tokens processed.",
    "generation_tokens": "Tokens generated.",
    "num_preemptions": "Requests preempted for lack of KV blocks.",
    "host_cache_hits": "Prompt tokens of prefix-cache hits served from the host KV tier.",
    "kv_offload_bytes": "KV bytes copied from the device tier to the host tier.",
    "kv_onload_bytes": "KV bytes copied from the host tier back to the device tier.",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time to first token.", TTFT_BUCKETS_S),
    "inter_token_latency_seconds": ("Time between successive output steps.", ITL_BUCKETS_S),
    "e2e_request_latency_seconds": ("Request latency from arrival to finish.", E2E_BUCKETS_S),
}


class Histogram:
    """Fixed-bucket histogram that travels as a plain dict."""

    def __init__(self, buckets_s: tuple[float, ...]) -> None:
        self.buckets_s = buckets_s
        self.counts = [0] * (len(buckets_s) + 1)  # the last one is +Inf
        self.sum_s = 0.0

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.buckets_s, value_s)] += 1
        self.sum_s += value_s

    def to_dict(self) -> dict:
        return {"buckets_s": list(self.buckets_s), "counts": list(self.counts), "sum_s": self.sum_s}


class ReplicaMetrics:
    """The latency histograms of one replica, fed by its request loop."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items()}

    def observe(self, name: str, value_s: float) -> None:
        if value_s >= 0.0:
            self.histograms[name].observe(value_s)

    def snapshot(self, engine_metrics: dict, *, alive: bool, model_name: str) -> dict:
        return {
            "alive": alive,
            "model_name": model_name,
            "engine": dict(engine_metrics),
            "histograms": {name: h.to_dict() for name, h in self.histograms.items()},
        }


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},  # one push per replica per second
)
class MetricsHub:
    """Latest snapshot of every replica; replicas push, the ingress reads.

    Also relays a drain order (``begin_drain``, sent by ``prefixserve serve`` on Ctrl-C) to
    every replica as the answer to its next push, because Serve offers no way to call all
    replicas of a deployment and gives user code no signal before it drains a replica.
    """

    def __init__(self) -> None:
        self._snapshots: dict[str, tuple[float, dict]] = {}
        self._drain_until_s: float | None = None

    def report(self, replica_id: str, snapshot: dict) -> float | None:
        """Stores the snapshot; returns the seconds left to drain, or None when serving."""
        now_s = time.monotonic()
        self._snapshots[replica_id] = (now_s, snapshot)
        if self._drain_until_s is None:
            return None
        return max(0.0, self._drain_until_s - now_s)

    def begin_drain(self, drain_timeout_s: float) -> None:
        """Replicas end their in-flight requests (finish_reason abort) after this long."""
        self._drain_until_s = time.monotonic() + drain_timeout_s

    def snapshots(self) -> dict[str, dict]:
        now = time.monotonic()
        for replica_id, (seen_at, _) in list(self._snapshots.items()):
            if now - seen_at > STALE_AFTER_S:
                del self._snapshots[replica_id]
        return {replica_id: snap for replica_id, (_, snap) in self._snapshots.items()}


def num_busy_requests(snapshots: dict[str, dict]) -> int:
    """Requests running or waiting over every replica that reported."""
    return sum(
        int(snap.get("engine", {}).get("num_requests_running", 0))
        + int(snap.get("engine", {}).get("num_requests_waiting", 0))
        for snap in snapshots.values()
    )


class _SnapshotCollector:
    def __init__(self, snapshots: dict[str, dict]) -> None:
        self.snapshots = snapshots

    def collect(self):
        labels = ["model_name", "replica"]
        families = {}
        for name, doc in GAUGES.items():
            families[name] = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
        for name, doc in COUNTERS.items():
            families[name] = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        for name, (doc, _) in HISTOGRAMS.items():
            families[name] = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
        for replica_id, snap in sorted(self.snapshots.items()):
            values = [snap.get("model_name", ""), replica_id]
            engine = snap.get("engine", {})
            for name in GAUGES:
                families[name].add_metric(values, float(engine.get(name, 0.0)))
            for name in COUNTERS:
                families[name].add_metric(values, float(engine.get(name + "_total", 0.0)))
            for name, hist in snap.get("histograms", {}).items():
                if name not in families:
                    continue
                cumulative, buckets = 0, []
                for bound_s, count in zip(hist["buckets_s"], hist["counts"][:-1], strict=True):
                    cumulative += count
                    buckets.append((repr(float(bound_s)), cumulative))
                cumulative += hist["counts"][-1]
                buckets.append(("+Inf", cumulative))
                families[name].add_metric(values, buckets, sum_value=hist["sum_s"])
        yield from families.values()


def _router_families(snapshot: dict):
    """``router.metrics.RouterMetrics.snapshot()`` as ``prefixserve:router_*`` families."""
    decisions = CounterMetricFamily(
        PREFIX + "router_decisions",
        "Routing decisions by policy and reason.",
        labels=["policy", "reason"],
    )
    for row in snapshot.get("decisions", []):
        decisions.add_metric([row["policy"], row["reason"]], float(row["count"]))
    yield decisions
    for name, doc in (
        ("num_prompt_blocks", "Prompt blocks of routed requests."),
        ("num_matched_blocks", "Prompt blocks the chosen replica was known to hold."),
        ("num_index_errors", "Prefix index lookups that failed."),
        ("num_fallback_decisions", "Decisions that fell back to load-only routing."),
    ):
        family = CounterMetricFamily(PREFIX + "router_" + name.removeprefix("num_"), doc)
        family.add_metric([], float(snapshot.get(name, 0)))
        yield family
    latency = snapshot.get("lookup_latency_ms")
    if latency:
        family = HistogramMetricFamily(
            PREFIX + "router_lookup_latency_seconds", "Prefix index lookup latency."
        )
        cumulative, buckets = 0, []
        for bound_ms, count in zip(latency["bounds"], latency["counts"][:-1], strict=True):
            cumulative += count
            buckets.append((repr(bound_ms / 1000.0), cumulative))
        buckets.append(("+Inf", cumulative + latency["counts"][-1]))
        family.add_metric([], buckets, sum_value=latency["sum"] / 1000.0)
        yield family


class _RouterCollector:
    def __init__(self, snapshot: dict) -> None:
        self.snapshot = snapshot

    def collect(self):
        yield from _router_families(self.snapshot)


def render_prometheus(snapshots: dict[str, dict], router_snapshot: dict | None = None) -> bytes:
    """Prometheus text of the replicas' snapshots (and of the router's, when given)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshots))
    if router_snapshot is not None:
        registry.register(_RouterCollector(router_snapshot))
    return generate_latest(registry)


def any_replica_serving(snapshots: dict[str, dict]) -> bool:
    return any(snap.get("alive", False) for snap in snapshots.values())
