"""Router metrics as plain, thread-safe counters and fixed-bucket histograms.

Owns what the router counts: decisions by policy and reason (a ``router.policy.RoutingReason``,
counted under its string value), matched blocks against prompt blocks (the matched-block
ratio), index lookup latency, whole-decision latency (from Serve asking the router to its
answer: the lookup, the in-flight board, the views and the policy) and the CPU time the
decision's thread spent on it (the latency less its waits for the GIL and for a core), index
errors, fallback decisions and dropped speculative entries. No Prometheus dependency here:
``snapshot()`` returns plain numbers, ``merge_snapshots`` adds two of them up (the routers of
one process, or of every ingress replica), and the cluster layer exports them (e.g., as
``prefixserve_router_*`` Prometheus series). Recording never blocks for longer than one
uncontended lock and never raises, except ``ValueError`` for a decision reason that is not
a ``RoutingReason`` (a programming error, not a runtime one).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from router.policy import RoutingReason

# Lookup latencies of interest span an in-process dict hit (~10 us) to a Redis round trip
# that hits the socket timeout (~50 ms); buckets are upper bounds in milliseconds.
LATENCY_BUCKETS_MS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)
LATENCY_HISTOGRAMS = ("lookup_latency_ms", "decision_latency_ms", "decision_cpu_ms")
"""The latency histograms a snapshot carries, each under this key."""


@dataclass
class Histogram:
    """Cumulative-free bucket counts; ``counts[i]`` counts values <= ``bounds[i]``,
    the last slot counts values above every bound."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_MS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.num += 1

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding quantile ``q``; None when empty or above all."""
        if self.num == 0:
            return None
        rank = q * self.num
        seen = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            seen += count
            if seen >= rank:
                return bound
        return None


class RouterMetrics:
    """Counters one router process keeps; safe to share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.decisions: dict[tuple[str, str], int] = {}
        """(policy, reason) -> number of decisions."""
        self.num_prompt_blocks = 0
        self.num_matched_blocks = 0
        self.num_index_errors = 0
        self.num_fallback_decisions = 0
        self.num_dropped_speculations = 0
        """Speculative entries dropped because the background writer's queue was full."""
        self.lookup_latency_ms = Histogram()
        self.decision_latency_ms = Histogram()
        self.decision_cpu_ms = Histogram()

    def record_decision(
        self, policy: str, reason: RoutingReason, num_prompt_blocks: int, num_matched_blocks: int
    ) -> None:
        """Count one decision; ``reason`` must be a ``RoutingReason`` (or its value: an
        unknown string raises ``ValueError``). Kept as the plain label string."""
        reason = RoutingReason(reason)
        with self._lock:
            key = (policy, reason.value)
            self.decisions[key] = self.decisions.get(key, 0) + 1
            self.num_prompt_blocks += num_prompt_blocks
            self.num_matched_blocks += num_matched_blocks
            if reason is RoutingReason.FALLBACK:
                self.num_fallback_decisions += 1

    def record_lookup(self, latency_ms: float) -> None:
        with self._lock:
            self.lookup_latency_ms.observe(latency_ms)

    def record_decision_latency(self, latency_ms: float, cpu_ms: float | None = None) -> None:
        """One decision's wall time and, when given, its thread's CPU time
        (``time.thread_time``): where the two differ, the decision waited for the GIL (another
        thread of the process) or for a core (other processes)."""
        with self._lock:
            self.decision_latency_ms.observe(latency_ms)
            if cpu_ms is not None:
                self.decision_cpu_ms.observe(cpu_ms)

    def record_index_error(self) -> None:
        with self._lock:
            self.num_index_errors += 1

    def record_dropped_speculation(self) -> None:
        with self._lock:
            self.num_dropped_speculations += 1

    @property
    def matched_block_ratio(self) -> float | None:
        """Matched blocks over prompt blocks across all decisions; None before any block."""
        if self.num_prompt_blocks == 0:
            return None
        return self.num_matched_blocks / self.num_prompt_blocks

    def snapshot(self) -> dict:
        """Plain, JSON-serializable copy of every metric."""
        with self._lock:
            return {
                "decisions": [
                    {"policy": policy, "reason": reason, "count": count}
                    for (policy, reason), count in sorted(self.decisions.items())
                ],
                "num_prompt_blocks": self.num_prompt_blocks,
                "num_matched_blocks": self.num_matched_blocks,
                "matched_block_ratio": self.matched_block_ratio,
                "num_index_errors": self.num_index_errors,
                "num_fallback_decisions": self.num_fallback_decisions,
                "num_dropped_speculations": self.num_dropped_speculations,
                **{name: _histogram_dict(getattr(self, name)) for name in LATENCY_HISTOGRAMS},
            }


def _histogram_dict(histogram: Histogram) -> dict:
    return {
        "bounds": list(histogram.bounds),
        "counts": list(histogram.counts),
        "sum": histogram.total,
        "count": histogram.num,
    }


def merge_snapshots(total: dict | None, snapshot: dict | None) -> dict | None:
    """Two ``RouterMetrics.snapshot()``s summed, as one (``{}`` or None is the empty sum):
    decisions by (policy, reason), block counts, errors, the ratio recomputed, the latency
    histograms added bucket by bucket (a snapshot without one adds nothing to it). For a
    process with several routers, or several processes."""
    if not total:
        return snapshot or total
    if not snapshot:
        return total
    counts: dict[tuple[str, str], int] = {}
    for row in total["decisions"] + snapshot["decisions"]:
        key = (row["policy"], row["reason"])
        counts[key] = counts.get(key, 0) + row["count"]
    merged = dict(total)
    merged["decisions"] = [
        {"policy": p, "reason": r, "count": c} for (p, r), c in sorted(counts.items())
    ]
    for name in (
        "num_prompt_blocks",
        "num_matched_blocks",
        "num_index_errors",
        "num_fallback_decisions",
        "num_dropped_speculations",
    ):
        merged[name] = total[name] + snapshot[name]
    prompt = merged["num_prompt_blocks"]
    merged["matched_block_ratio"] = merged["num_matched_blocks"] / prompt if prompt else None
    for name in LATENCY_HISTOGRAMS:
        ours, theirs = total.get(name), snapshot.get(name)
        if ours is None or theirs is None:
            merged[name] = ours or theirs
            continue
        merged[name] = {
            "bounds": ours["bounds"],
            "counts": [a + b for a, b in zip(ours["counts"], theirs["counts"], strict=True)],
            "sum": ours["sum"] + theirs["sum"],
            "count": ours["count"] + theirs["count"],
        }
    return merged
