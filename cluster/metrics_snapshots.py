"""The plain snapshots every process pushes to the ``MetricsHub``: fixed-bucket ``Histogram``s,
``ReplicaMetrics`` (an engine replica's histograms and counters) and ``IngressMetrics`` (what
clients see at one ingress replica), and ``sum_ingress_snapshots`` (the ingresses' sum).

Snapshots are dicts of numbers so they pickle cheaply across Ray; no Ray or Prometheus here.
Summing is forgiving: histograms whose bounds differ (ingress replicas of two configs) keep the
first seen, and a router snapshot that is None adds nothing; an unknown histogram name passed
to ``observe`` is a ``KeyError`` (a programming error).
"""

from __future__ import annotations

import bisect

from cluster.metrics_series import (
    FINISHED_REASONS,
    HISTOGRAMS,
    INGRESS_HISTOGRAMS,
    REPLICA_COUNTERS,
    TOKEN_HISTOGRAMS,
    token_buckets,
)
from cluster.stream_items import prefill_time_s
from router.metrics import merge_snapshots
from worker.outputs import OutputDelta


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

    def snapshot(
        self,
        engine_metrics: dict,
        *,
        alive: bool,
        model_name: str,
        info: dict[str, dict[str, str]] | None = None,
    ) -> dict:
        """``info``: the label values of each ``INFO_GAUGES`` series, by series name (the
        replica's static configuration, e.g. ``cache_config_info``'s block size and KV
        format)."""
        return {
            "alive": alive,
            "model_name": model_name,
            "engine": dict(engine_metrics),
            "histograms": {name: h.to_dict() for name, h in self.histograms.items()},
            "counters": dict(self.counters),
            "info": {name: dict(labels) for name, labels in (info or {}).items()},
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

    def started(self, arrival_s: float, first_outputs: list[OutputDelta], now_s: float) -> None:
        """``first_outputs``: each prompt's first replica output (with the engine's timestamps,
        whose prefill time ``stream_items.prefill_time_s`` reads)."""
        ttft_s = max(0.0, now_s - arrival_s)
        self.histograms["time_to_first_token_seconds"].observe(ttft_s)
        prefill_s = [s for s in map(prefill_time_s, first_outputs) if s is not None]
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
        total["router"] = merge_snapshots(total["router"], snap.get("router"))
    return total
