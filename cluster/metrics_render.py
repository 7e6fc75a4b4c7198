"""``/metrics``: Prometheus text of the engine replicas' snapshots, the ingresses' summed
snapshot and the routers' counters (``render_prometheus``), every name under a prefix.

One collector per kind of snapshot, registered in a fresh registry per scrape (nothing global,
so two applications' prefixes never mix). Rendering reads snapshots defensively: a missing
gauge or counter renders as 0, a histogram of an unknown name or without bounds (a replica
of an older version) is skipped rather than failing the scrape, and an info gauge
(``cache_config_info``) is rendered only for the replicas whose snapshot carries it.
"""

from __future__ import annotations

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import generate_latest

from cluster.metrics_series import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    INFO_GAUGES,
    INGRESS_HISTOGRAMS,
    PREFIX,
    REPLICA_COUNTERS,
    TOKEN_HISTOGRAMS,
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
        for name, (doc, keys) in INFO_GAUGES.items():
            families[name] = GaugeMetricFamily(self.prefix + name, doc, labels=labels + list(keys))
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
            for name, info in snap.get("info", {}).items():
                if name in INFO_GAUGES:  # a label missing from the snapshot renders as ""
                    keys = INFO_GAUGES[name][1]
                    families[name].add_metric(values + [str(info.get(k, "")) for k in keys], 1.0)
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
    for key, name, doc in (
        ("lookup_latency_ms", "router_lookup_latency_seconds", "Prefix index lookup latency."),
        (
            "decision_latency_ms",
            "router_decision_latency_seconds",
            "Routing decision latency: lookup, in-flight board, load views and policy.",
        ),
        (
            "decision_cpu_ms",
            "router_decision_cpu_seconds",
            "CPU time of a routing decision on its thread: its latency less its waits for the "
            "GIL and for a core.",
        ),
    ):
        latency = snapshot.get(key)
        if not latency:
            continue
        family = HistogramMetricFamily(prefix + name, doc)
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
