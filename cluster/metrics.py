"""All Prometheus export: vLLM's series names under a prefix (``prefixserve:`` or
``--metrics-prefix``).

Two kinds of process count, and both push plain snapshots every ``METRICS_PUSH_PERIOD_S``
to the one ``MetricsHub`` deployment of the application:

- Each engine replica (``ReplicaMetrics``): the engine's counters and gauges
  (``AsyncEngine.metrics()``) and the engine-side histograms (inter-token latency, prefill,
  decode and inference time, the engine's own TTFT, queue time and e2e), labelled by
  ``model_name`` and ``replica``. A replica that stops reporting drops out after
  ``STALE_AFTER_S``.
- Each ingress replica (``IngressMetrics``): what a client sees, timed from the moment the
  ingress handler starts (TTFT, end-to-end latency, queue time up to the start of prefill),
  the request-level token histograms, ``request_success_total{finished_reason}``, and its
  process's router counters. These are cumulative, so the hub keeps an ingress's last
  snapshot even after it stops reporting: the sum over ingress replicas never goes down
  while the hub lives (a hub restart is a counter reset, which Prometheus handles).

Any ingress replica answers ``/metrics``: it renders the hub's replica snapshots and the sum of
every ingress's snapshot (its own taken fresh) with ``render_prometheus``, ingress series
labelled by ``model_name`` only. A hub that is down costs metrics and health, never serving;
the ingress then renders its own counts alone. docs/metrics.md maps every series to vLLM's.
"""

from __future__ import annotations

import bisect
import time
import weakref

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import generate_latest
from ray import serve

from cluster.priority import lower_own_priority

PREFIX = "prefixserve:"
"""The default series-name prefix (``ClusterConfig.metrics_prefix``); ``vllm:`` makes vLLM's
dashboards and autoscaling rules read ours unchanged."""
# The request routers (``cluster.request_router``) alive in this process, for /metrics. Kept
# here because Serve ships the router class to a handle's process pickled by value, with
# copies of its own module's globals: a registry there would stay empty for the ingress.
_REQUEST_ROUTERS: weakref.WeakSet = weakref.WeakSet()


def register_request_router(request_router) -> None:
    _REQUEST_ROUTERS.add(request_router)


def request_routers() -> list:
    """The request routers alive in this process (one per handle's deployment)."""
    return list(_REQUEST_ROUTERS)


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

# vLLM uses its e2e buckets for every per-request phase (queue, prefill, decode, inference).
REQUEST_PHASE_BUCKETS_S = E2E_BUCKETS_S


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            bound = mantissa * scale
            if bound > max_model_len:
                return tuple(float(b) for b in bounds)
            bounds.append(bound)
        scale *= 10


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
    "engine_time_to_first_token_seconds": (
        "Time from the engine's arrival of a request to its first token.",
        TTFT_BUCKETS_S,
    ),
    "inter_token_latency_seconds": ("Time between successive output steps.", ITL_BUCKETS_S),
    "engine_e2e_request_latency_seconds": (
        "Time from the engine's arrival of a request to its finish.",
        E2E_BUCKETS_S,
    ),
    "engine_queue_time_seconds": (
        "Time a request waited in the engine before its first scheduling.",
        REQUEST_PHASE_BUCKETS_S,
    ),
    "request_prefill_time_seconds": (
        "Time from a request's first scheduling to its first token.",
        REQUEST_PHASE_BUCKETS_S,
    ),
    "request_decode_time_seconds": (
        "Time from a request's first token to its finish.",
        REQUEST_PHASE_BUCKETS_S,
    ),
    "request_inference_time_seconds": (
        "Time from a request's first scheduling to its finish.",
        REQUEST_PHASE_BUCKETS_S,
    ),
    "kv_pull_seconds": (
        "Time of each KV pull from a peer replica, the order to the import or the failure.",
        TTFT_BUCKETS_S,
    ),
}
REPLICA_COUNTERS = {
    "kv_pulls": "KV pulls from a peer replica, ordered by the router (cluster/kv_pull.py).",
    "kv_pull_failures": "KV pulls that failed or timed out; their requests prefilled instead.",
    "kv_pull_blocks": "KV blocks imported from peer replicas.",
    "kv_pull_tokens": "Prompt tokens whose KV came from peer replicas.",
    "kv_pull_bytes": "KV bytes received from peer replicas.",
}
"""Counted by the replica itself (``ReplicaMetrics.count``), not by the engine."""
INGRESS_HISTOGRAMS = {
    "time_to_first_token_seconds": (
        "Time from the ingress receiving a request to its first output there.",
        TTFT_BUCKETS_S,
    ),
    "e2e_request_latency_seconds": (
        "Time from the ingress receiving a request to its last output there.",
        E2E_BUCKETS_S,
    ),
    "request_queue_time_seconds": (
        "Time from the ingress receiving a request to the start of its prefill "
        "(tokenization, routing, Serve's queue, the engine's queue).",
        REQUEST_PHASE_BUCKETS_S,
    ),
}
TOKEN_HISTOGRAMS = {
    "request_prompt_tokens": "Prompt tokens of each finished engine request.",
    "request_generation_tokens": "Generated tokens of each finished choice.",
}
FINISHED_REASONS = ("stop", "length", "abort", "error")
"""``request_success_total``'s ``finished_reason`` values: vLLM's, and ``error`` for a choice
cut short by a failure (``abort``: the client left or the cluster drained)."""


class Histogram:
    """Fixed-bucket histogram that travels as a plain dict (bounds in the metric's unit)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def to_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


def _add_histograms(total: dict | None, hist: dict) -> dict:
    """The sum of two ``Histogram.to_dict()`` with the same bounds (``hist`` when ``total`` is
    None); different bounds (a config change between ingress replicas) keep ``total``."""
    if total is None:
        return {**hist, "counts": list(hist["counts"])}
    if total["bounds"] != hist["bounds"]:
        return total
    counts = [a + b for a, b in zip(total["counts"], hist["counts"], strict=True)]
    return {"bounds": total["bounds"], "counts": counts, "sum": total["sum"] + hist["sum"]}


class ReplicaMetrics:
    """The engine-side histograms of one replica, fed by its request loop."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items()}
        self.counters = dict.fromkeys(REPLICA_COUNTERS, 0)

    def observe(self, name: str, value_s: float) -> None:
        if value_s >= 0.0:
            self.histograms[name].observe(value_s)

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] += amount

    def snapshot(self, engine_metrics: dict, *, alive: bool, model_name: str) -> dict:
        return {
            "alive": alive,
            "model_name": model_name,
            "engine": dict(engine_metrics),
            "histograms": {name: h.to_dict() for name, h in self.histograms.items()},
            "counters": dict(self.counters),
        }


class IngressMetrics:
    """What clients see at one ingress replica: per request a few clock reads and counters.

    ``started`` runs once the first output of every prompt is in (TTFT; queue time when the
    engine says how long its prefill took), ``finished`` once the response ended, however it
    ended (e2e latency, the token histograms, ``request_success_total`` per choice).
    """

    def __init__(self, max_model_len: int) -> None:
        self.histograms = {
            name: Histogram(buckets) for name, (_, buckets) in INGRESS_HISTOGRAMS.items()
        }
        tokens = token_buckets(max_model_len)
        self.histograms.update({name: Histogram(tokens) for name in TOKEN_HISTOGRAMS})
        self.finished_reasons: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)

    def started(self, arrival_s: float, first_outputs: list[dict], now_s: float) -> None:
        """``first_outputs``: each prompt's first replica output (``prefill_time_s`` in it)."""
        ttft_s = max(0.0, now_s - arrival_s)
        self.histograms["time_to_first_token_seconds"].observe(ttft_s)
        prefill_s = [out["prefill_time_s"] for out in first_outputs if "prefill_time_s" in out]
        if prefill_s:  # the slowest prompt's prefill ends at the TTFT; before it, waiting
            queue_s = max(0.0, ttft_s - max(prefill_s))
            self.histograms["request_queue_time_seconds"].observe(queue_s)

    def finished(
        self,
        arrival_s: float,
        now_s: float,
        prompt_tokens: list[int],
        choices: list[tuple[str | None, int]],
        unfinished_reason: str,
    ) -> None:
        """``choices``: (finish reason or None, generated tokens) per choice; a choice without
        a reason counts as ``unfinished_reason`` (``abort`` or ``error``)."""
        self.histograms["e2e_request_latency_seconds"].observe(max(0.0, now_s - arrival_s))
        for num_tokens in prompt_tokens:
            self.histograms["request_prompt_tokens"].observe(num_tokens)
        generation = self.histograms["request_generation_tokens"]
        for reason, num_tokens in choices:
            reason = reason or unfinished_reason
            self.finished_reasons[reason] = self.finished_reasons.get(reason, 0) + 1
            generation.observe(num_tokens)

    def snapshot(self, model_name: str, router: dict | None) -> dict:
        return {
            "model_name": model_name,
            "histograms": {name: h.to_dict() for name, h in self.histograms.items()},
            "finished_reasons": dict(self.finished_reasons),
            "router": router,
        }


def _add_router(total: dict | None, snapshot: dict | None) -> dict | None:
    """Two ``RouterMetrics.snapshot()`` dicts summed (either may be None)."""
    if total is None or snapshot is None:
        return snapshot if total is None else total
    decisions: dict[tuple[str, str], int] = {}
    for row in total["decisions"] + snapshot["decisions"]:
        key = (row["policy"], row["reason"])
        decisions[key] = decisions.get(key, 0) + row["count"]
    merged = {
        name: total.get(name, 0) + snapshot.get(name, 0)
        for name in total.keys() | snapshot.keys()
        if name.startswith("num_")
    }
    merged["decisions"] = [
        {"policy": policy, "reason": reason, "count": count}
        for (policy, reason), count in sorted(decisions.items())
    ]
    prompt = merged.get("num_prompt_blocks", 0)
    merged["matched_block_ratio"] = merged.get("num_matched_blocks", 0) / prompt if prompt else None
    ours, theirs = total["lookup_latency_ms"], snapshot["lookup_latency_ms"]
    merged["lookup_latency_ms"] = {
        "bounds": ours["bounds"],
        "counts": [a + b for a, b in zip(ours["counts"], theirs["counts"], strict=True)],
        "sum": ours["sum"] + theirs["sum"],
        "count": ours["count"] + theirs["count"],
    }
    return merged


def sum_ingress_snapshots(snapshots) -> dict | None:
    """``IngressMetrics.snapshot()`` dicts of every ingress replica, summed; None for none."""
    total: dict | None = None
    for snap in snapshots:
        if total is None:
            total = {
                "model_name": snap["model_name"],
                "histograms": {},
                "finished_reasons": {},
                "ignored_fields": {},
                "router": None,
            }
        for name, hist in snap["histograms"].items():
            total["histograms"][name] = _add_histograms(total["histograms"].get(name), hist)
        for reason, count in snap["finished_reasons"].items():
            total["finished_reasons"][reason] = total["finished_reasons"].get(reason, 0) + count
        for name, count in snap.get("ignored_fields", {}).items():
            total["ignored_fields"][name] = total["ignored_fields"].get(name, 0) + count
        total["router"] = _add_router(total["router"], snap.get("router"))
    return total


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

    def __init__(self, support_nice: int = 0) -> None:
        lower_own_priority(support_nice, "metrics hub")
        self._snapshots: dict[str, tuple[float, dict]] = {}
        self._ingress_snapshots: dict[str, dict] = {}
        """Cumulative counts: kept after an ingress stops, so their sum never goes down."""
        self._drain_until_s: float | None = None

    def report(self, replica_id: str, snapshot: dict) -> float | None:
        """Stores the snapshot; returns the seconds left to drain, or None when serving."""
        now_s = time.monotonic()
        self._snapshots[replica_id] = (now_s, snapshot)
        if self._drain_until_s is None:
            return None
        return max(0.0, self._drain_until_s - now_s)

    def report_ingress(self, ingress_id: str, snapshot: dict) -> None:
        """Stores an ingress replica's ``IngressMetrics.snapshot()``."""
        self._ingress_snapshots[ingress_id] = snapshot

    def export(self) -> dict:
        """What ``/metrics`` renders: live engine replicas and every ingress snapshot."""
        return {"replicas": self.snapshots(), "ingresses": dict(self._ingress_snapshots)}

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


def _cumulative_buckets(hist: dict) -> list[tuple[str, float]]:
    """A ``Histogram.to_dict()`` as Prometheus's cumulative ``le`` buckets, ``+Inf`` last."""
    cumulative, buckets = 0, []
    for bound, count in zip(hist["bounds"], hist["counts"][:-1], strict=True):
        cumulative += count
        buckets.append((repr(float(bound)), cumulative))
    buckets.append(("+Inf", cumulative + hist["counts"][-1]))
    return buckets


class _SnapshotCollector:
    def __init__(self, snapshots: dict[str, dict], prefix: str) -> None:
        self.snapshots = snapshots
        self.prefix = prefix

    def collect(self):
        labels = ["model_name", "replica"]
        families = {}
        for name, doc in GAUGES.items():
            families[name] = GaugeMetricFamily(self.prefix + name, doc, labels=labels)
        for name, doc in {**COUNTERS, **REPLICA_COUNTERS}.items():
            families[name] = CounterMetricFamily(self.prefix + name, doc, labels=labels)
        for name, (doc, _) in HISTOGRAMS.items():
            families[name] = HistogramMetricFamily(self.prefix + name, doc, labels=labels)
        for replica_id, snap in sorted(self.snapshots.items()):
            values = [snap.get("model_name", ""), replica_id]
            engine = snap.get("engine", {})
            for name in GAUGES:
                families[name].add_metric(values, float(engine.get(name, 0.0)))
            for name in COUNTERS:
                families[name].add_metric(values, float(engine.get(name + "_total", 0.0)))
            counters = snap.get("counters", {})
            for name in REPLICA_COUNTERS:
                families[name].add_metric(values, float(counters.get(name, 0)))
            for name, hist in snap.get("histograms", {}).items():
                if name in HISTOGRAMS and "bounds" in hist:  # a replica of an older version: skip
                    families[name].add_metric(
                        values, _cumulative_buckets(hist), sum_value=hist["sum"]
                    )
        yield from families.values()


class _IngressCollector:
    """The ingress replicas' summed snapshot, labelled by ``model_name`` only."""

    def __init__(self, snapshot: dict, prefix: str) -> None:
        self.snapshot = snapshot
        self.prefix = prefix

    def collect(self):
        values = [self.snapshot.get("model_name", "")]
        docs = {name: doc for name, (doc, _) in INGRESS_HISTOGRAMS.items()} | TOKEN_HISTOGRAMS
        for name, doc in docs.items():
            hist = self.snapshot["histograms"].get(name)
            if hist is None:
                continue
            family = HistogramMetricFamily(self.prefix + name, doc, labels=["model_name"])
            family.add_metric(values, _cumulative_buckets(hist), sum_value=hist["sum"])
            yield family
        success = CounterMetricFamily(
            self.prefix + "request_success",
            "Finished choices by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(self.snapshot["finished_reasons"].items()):
            success.add_metric(values + [reason], float(count))
        yield success
        ignored = CounterMetricFamily(
            self.prefix + "request_ignored_fields",
            "Requests that carried a field the API does not know (ignored), by field name.",
            labels=["model_name", "field"],
        )
        for name, count in sorted(self.snapshot.get("ignored_fields", {}).items()):
            ignored.add_metric(values + [name], float(count))
        yield ignored


def _router_families(snapshot: dict, prefix: str = PREFIX):
    """``router.metrics.RouterMetrics.snapshot()`` as ``<prefix>router_*`` families."""
    decisions = CounterMetricFamily(
        prefix + "router_decisions",
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
        (
            "num_dropped_speculations",
            "Speculative index entries dropped because the writer's queue was full.",
        ),
    ):
        family = CounterMetricFamily(prefix + "router_" + name.removeprefix("num_"), doc)
        family.add_metric([], float(snapshot.get(name, 0)))
        yield family
    latency = snapshot.get("lookup_latency_ms")
    if latency:
        family = HistogramMetricFamily(
            prefix + "router_lookup_latency_seconds", "Prefix index lookup latency."
        )
        cumulative, buckets = 0, []
        for bound_ms, count in zip(latency["bounds"], latency["counts"][:-1], strict=True):
            cumulative += count
            buckets.append((repr(bound_ms / 1000.0), cumulative))
        buckets.append(("+Inf", cumulative + latency["counts"][-1]))
        family.add_metric([], buckets, sum_value=latency["sum"] / 1000.0)
        yield family


class _RouterCollector:
    def __init__(self, snapshot: dict, prefix: str) -> None:
        self.snapshot = snapshot
        self.prefix = prefix

    def collect(self):
        yield from _router_families(self.snapshot, self.prefix)


def render_prometheus(
    snapshots: dict[str, dict],
    router_snapshot: dict | None = None,
    *,
    ingress_snapshot: dict | None = None,
    prefix: str = PREFIX,
) -> bytes:
    """Prometheus text of the engine replicas' snapshots, and of the ingresses' summed
    snapshot and the routers' (each when given), every series name under ``prefix`` (a
    trailing ``:`` added when missing)."""
    prefix = prefix.rstrip(":") + ":"
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshots, prefix))
    if ingress_snapshot is not None:
        registry.register(_IngressCollector(ingress_snapshot, prefix))
    if router_snapshot is not None:
        registry.register(_RouterCollector(router_snapshot, prefix))
    return generate_latest(registry)


def any_replica_serving(snapshots: dict[str, dict]) -> bool:
    return any(snap.get("alive", False) for snap in snapshots.values())
