"""Routing policies: which replica gets a request, priced in seconds of predicted TTFT.

Owns the interface the simulator and the cluster import (``ReplicaView``, ``Decision``,
``RoutingPolicy``, ``make_policy``), the TTFT model, rendezvous hashing, the ``prefix``
policy and the ``round_robin``/``least_loaded``/``pow2`` baselines. ``routing.Router``
combines a policy with an index; policies themselves do no I/O.

The ``prefix`` policy, in two steps:
1. Load bound. Candidates are the replicas whose count of requests this router recently
   sent them (``RecentCounts``, a decayed window of ``load_window_per_replica`` decisions
   per replica) stays within ``max_load_ratio`` x the mean + ``LOAD_BOUND_SLACK_REQUESTS``
   after this one (bounded-load hashing), or that hold fewer requests right now than every
   replica under the bound (other routers' traffic). A hot prefix whose holder is at the bound goes to
   the cheapest other replica, which then holds a copy and shares it. None turns this off.
2. Price. Every candidate costs
   ``queue_s + miss_cost_factor * miss_tokens / prefill_rate + host_tokens / host_rate
   + (one decode step if the replica is busy)``, where ``queue_s = queued_prefill_tokens /
   prefill_rate + (waiting + unreported in-flight) * step_s``: chunked prefill shares each
   step with the running decodes. Candidates within ``tie_tolerance_s`` of the minimum tie;
   ties prefer the longest match, then the fewest requests on the replica, then the fewest
   recently sent (spreads new prefixes, like SGLang's smallest tree), then rendezvous
   (highest random weight) hashing of the first block.
How it fails: the bound trades hits for balance. A prefix popular enough to exceed the
bound on one replica is re-prefilled on another (its hit rate drops by one prefill per
copy), and routers that share no history balance only their own traffic. Unmeasured rates
fall back to the configured defaults. ``choose`` raises ``ValueError`` on an empty
candidate list.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from router.config import RouterConfig
from router.index import Match
from router.protocol import BlockHash, ReplicaStats

REASONS = ("prefix", "cold", "tie", "load", "fallback")

# Additive room of the load bound, in requests: early on (or at low traffic) the mean recent
# count is near 0 and a pure ratio would spill a prefix's second request; 2 lets a prefix's
# first few requests stay together before the ratio takes over.
LOAD_BOUND_SLACK_REQUESTS = 2.0


@dataclass(frozen=True)
class ReplicaView:
    """One routing candidate: its last reported stats plus the router's own in-flight count."""

    replica_id: str
    stats: ReplicaStats
    num_inflight: int = 0


@dataclass(frozen=True)
class Decision:
    replica_id: str
    predicted_ttft_s: float
    matched_blocks: int
    """Leading blocks of the request the chosen replica holds (device + host tiers)."""
    reason: str
    """One of ``REASONS``: why this replica won."""


class RoutingPolicy(Protocol):
    name: str

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        replicas: Sequence[ReplicaView],
        matches: Mapping[str, Match],
    ) -> Decision: ...


def rendezvous_weight(key: bytes, replica_id: str) -> int:
    """Highest-random-weight score of ``replica_id`` for ``key``; same on every router."""
    return xxhash.xxh3_64_intdigest(key + b"\0" + replica_id.encode())


def rendezvous_pick(key: bytes, replica_ids: Sequence[str]) -> str:
    return max(replica_ids, key=lambda rid: (rendezvous_weight(key, rid), rid))


class TTFTModel:
    """Predicted time to first token of a request on one replica, from its stats."""

    def __init__(self, config: RouterConfig) -> None:
        self.block_size = config.block_size
        self.default_prefill_tokens_per_s = config.default_prefill_tokens_per_s
        self.default_decode_step_s = config.default_decode_step_s
        self.default_host_to_device_tokens_per_s = config.default_host_to_device_tokens_per_s

    def prefill_tokens_per_s(self, stats: ReplicaStats) -> float:
        return stats.prefill_tokens_per_s or self.default_prefill_tokens_per_s

    def decode_step_s(self, stats: ReplicaStats) -> float:
        if stats.decode_tokens_per_s > 0 and stats.num_running > 0:
            return stats.num_running / stats.decode_tokens_per_s
        return self.default_decode_step_s

    def queue_s(self, view: ReplicaView) -> float:
        """Wait before this replica starts a new prefill: the prompt tokens queued ahead, plus
        one decode step per request ahead (chunked prefill shares each step with the running
        decodes). Requests the router sent that the stats do not show yet count as waiting."""
        stats = view.stats
        num_ahead = stats.num_waiting + _unreported(view)
        return (
            stats.num_queued_prefill_tokens / self.prefill_tokens_per_s(stats)
            + num_ahead * self.decode_step_s(stats)
        )

    def predicted_ttft_s(
        self, view: ReplicaView, match: Match | None, num_prompt_tokens: int, miss_cost_factor: float = 1.0
    ) -> float:
        """``miss_cost_factor`` > 1 also charges the prefill a miss adds to that replica's queue
        (the delay it imposes on the requests behind it); 1 is the request's own TTFT. The
        request's own prefill shares a step with the running decodes when there are any."""
        stats = view.stats
        num_device_tokens = num_host_tokens = 0
        if match is not None:
            num_device_tokens = min(match.device_blocks * self.block_size, num_prompt_tokens)
            num_host_tokens = min(
                match.host_blocks * self.block_size, num_prompt_tokens - num_device_tokens
            )
        num_miss_tokens = num_prompt_tokens - num_device_tokens - num_host_tokens
        host_rate = stats.host_to_device_tokens_per_s or self.default_host_to_device_tokens_per_s
        busy = stats.num_running + stats.num_waiting + _unreported(view) > 0
        return (
            self.queue_s(view)
            + miss_cost_factor * num_miss_tokens / self.prefill_tokens_per_s(stats)
            + num_host_tokens / host_rate
            + (self.decode_step_s(stats) if busy else 0.0)
        )


def _check(replicas: Sequence[ReplicaView], num_prompt_tokens: int) -> None:
    if not replicas:
        raise ValueError("replicas must hold at least one candidate")
    if num_prompt_tokens < 0:
        raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")


def _matched(matches: Mapping[str, Match], replica_id: str) -> int:
    match = matches.get(replica_id)
    return 0 if match is None else match.num_blocks


class RecentCounts:
    """Requests this router sent to each replica, decayed per decision (not per second).

    Each decision multiplies every count by ``1 - 1 / (window_per_replica * num_replicas)``
    and adds 1 to the chosen replica, so the counts sum to about ``window_per_replica`` per
    replica: the recent rate, with no clock (the simulator and the cluster agree) and in O(1)
    per decision (one global scale, renormalized when it grows large). A replica that joins
    starts at 0 and catches up within a window instead of being flooded until its lifetime
    count matches the others'. Not thread-safe: the policy holds its lock around it.
    """

    _RENORMALIZE_AT = 1e12

    def __init__(self, window_per_replica: float) -> None:
        self.window_per_replica = window_per_replica
        self._raw: dict[str, float] = {}
        self._scale = 1.0  # true count = raw / scale

    def get(self, replica_id: str) -> float:
        return self._raw.get(replica_id, 0.0) / self._scale

    def add(self, replica_id: str, num_replicas: int, amount: float = 1.0) -> None:
        self._scale /= 1.0 - 1.0 / (self.window_per_replica * max(num_replicas, 1))
        self._raw[replica_id] = self._raw.get(replica_id, 0.0) + amount * self._scale
        if self._scale > self._RENORMALIZE_AT:
            self._raw = {k: v / self._scale for k, v in self._raw.items() if v / self._scale > 1e-6}
            self._scale = 1.0


class PrefixPolicy:
    """Minimum predicted TTFT among the replicas under the load bound; ties by longest match,
    then fewest requests in flight, then fewest recently sent, then rendezvous."""

    name = "prefix"

    def __init__(self, config: RouterConfig) -> None:
        self.model = TTFTModel(config)
        self.tie_tolerance_s = config.tie_tolerance_s
        self.miss_cost_factor = config.miss_cost_factor
        self.max_load_ratio = config.max_load_ratio
        self._recent = RecentCounts(config.load_window_per_replica)
        self._lock = threading.Lock()

    def _under_bound(self, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Replicas that may take one more request without their recent count passing
        ``max_load_ratio`` times the mean plus ``LOAD_BOUND_SLACK_REQUESTS`` (bounded-load
        consistent hashing, Mirrokni et al. 2018, over the router's recent counts)."""
        if self.max_load_ratio is None or len(replicas) == 1:
            return list(replicas)
        counts = [self._recent.get(v.replica_id) for v in replicas]
        bound = self.max_load_ratio * sum(counts) / len(replicas) + LOAD_BOUND_SLACK_REQUESTS
        under = [n + 1.0 <= bound for n in counts]
        if all(under):
            return list(replicas)
        # The counts see only this router's traffic: a replica over the bound stays a candidate
        # when it is strictly less loaded right now than every replica under it.
        least_under = min(_load(v) for v, ok in zip(replicas, under, strict=True) if ok)
        return [v for v, ok in zip(replicas, under, strict=True) if ok or _load(v) < least_under]

    def choose(self, block_hashes, num_prompt_tokens, replicas, matches) -> Decision:
        _check(replicas, num_prompt_tokens)
        with self._lock:
            candidates = self._under_bound(replicas)
            view, longest, reason = self._pick(block_hashes, num_prompt_tokens, candidates, matches)
            if len(candidates) < len(replicas) and reason != "load":
                best_all_s = min(self._cost(v, matches, num_prompt_tokens) for v in replicas)
                chosen_s = self._cost(view, matches, num_prompt_tokens)
                if best_all_s + self.tie_tolerance_s < chosen_s:
                    reason = "load"  # the bound, not the price, decided
            self._recent.add(view.replica_id, len(replicas))
        ttft_s = self.model.predicted_ttft_s(view, matches.get(view.replica_id), num_prompt_tokens)
        return Decision(view.replica_id, ttft_s, longest, reason)

    def _cost(self, view, matches, num_prompt_tokens) -> float:
        return self.model.predicted_ttft_s(
            view, matches.get(view.replica_id), num_prompt_tokens, self.miss_cost_factor
        )

    def _pick(self, block_hashes, num_prompt_tokens, replicas, matches):
        scored = [(self._cost(v, matches, num_prompt_tokens), v) for v in replicas]
        best_s = min(score for score, _ in scored)
        tied = [v for score, v in scored if score <= best_s + self.tie_tolerance_s]
        longest = max(_matched(matches, v.replica_id) for v in tied)
        tied = [v for v in tied if _matched(matches, v.replica_id) == longest]
        if len(tied) == 1:
            return tied[0], longest, ("prefix" if longest > 0 else "load")
        # Equal cost and equal match: the least loaded, then the least recently used (spreads
        # new prefixes like SGLang's smallest tree), then rendezvous on the first block, so
        # a cold prefix lands where every router with the same history agrees.
        least = min(_load(v) for v in tied)
        tied = [v for v in tied if _load(v) == least]
        fewest = min(round(self._recent.get(v.replica_id)) for v in tied)
        tied = [v for v in tied if round(self._recent.get(v.replica_id)) == fewest]
        key = block_hashes[0] if block_hashes else b""
        chosen_id = rendezvous_pick(key, [v.replica_id for v in tied])
        view = next(v for v in tied if v.replica_id == chosen_id)
        any_match = any(_matched(matches, v.replica_id) for v in replicas)
        return view, longest, ("tie" if any_match else "cold")


def _load(view: ReplicaView) -> int:
    """Requests on the replica: its reported waiting + running, or the router's own in-flight
    count when that is larger (decisions the stats do not show yet)."""
    return max(view.stats.num_waiting + view.stats.num_running, view.num_inflight)


def _unreported(view: ReplicaView) -> int:
    return max(0, view.num_inflight - view.stats.num_waiting - view.stats.num_running)


class _Baseline:
    """Shared plumbing of the load-only baselines: they ignore matches but report them."""

    name = "baseline"

    def __init__(self, config: RouterConfig) -> None:
        self.model = TTFTModel(config)

    def _pick(self, block_hashes, replicas: Sequence[ReplicaView]) -> ReplicaView:
        raise NotImplementedError

    def choose(self, block_hashes, num_prompt_tokens, replicas, matches) -> Decision:
        _check(replicas, num_prompt_tokens)
        view = self._pick(block_hashes, replicas)
        match = matches.get(view.replica_id)
        ttft_s = self.model.predicted_ttft_s(view, match, num_prompt_tokens)
        return Decision(view.replica_id, ttft_s, _matched(matches, view.replica_id), "load")


class RoundRobinPolicy(_Baseline):
    name = "round_robin"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def _pick(self, block_hashes, replicas):
        with self._lock:
            turn = next(self._counter)
        return sorted(replicas, key=lambda v: v.replica_id)[turn % len(replicas)]


class LeastLoadedPolicy(_Baseline):
    """Fewest waiting + running + in-flight requests; ties by rendezvous on the first block."""

    name = "least_loaded"

    def _pick(self, block_hashes, replicas):
        key = block_hashes[0] if block_hashes else b""
        return min(replicas, key=lambda v: (_load(v), -rendezvous_weight(key, v.replica_id)))


class Pow2Policy(_Baseline):
    """Power of two choices: the less loaded of two candidates drawn at random."""

    name = "pow2"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()

    def _pick(self, block_hashes, replicas):
        if len(replicas) == 1:
            return replicas[0]
        with self._lock:
            first, second = self._rng.sample(list(replicas), 2)
        return second if _load(second) < _load(first) else first


_POLICIES = {
    "prefix": PrefixPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "pow2": Pow2Policy,
}


def make_policy(config: RouterConfig) -> RoutingPolicy:
    """The policy ``config.policy`` names (validated by ``RouterConfig``)."""
    return _POLICIES[config.policy](config)
