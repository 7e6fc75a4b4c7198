"""Routing policies: which replica gets a request, priced in seconds of predicted TTFT.

Owns the interface the simulator and the cluster import (``ReplicaView``, ``Decision``,
``RoutingPolicy``, ``make_policy``), the TTFT model, rendezvous hashing, the ``prefix``
policy and the ``round_robin``/``least_loaded``/``pow2`` baselines. ``routing.Router``
combines a policy with an index; policies themselves do no I/O.

The ``prefix`` policy prices every candidate as
``queue_s + miss_tokens / prefill_rate + host_tokens / host_to_device_rate`` where
``queue_s = queued_prefill_tokens / prefill_rate + (waiting + router in-flight) * step_s``
and picks the minimum. Candidates within ``tie_tolerance_s`` of the minimum tie; ties
prefer the longest match, then rendezvous (highest random weight) hashing of the request's
first block, so independent routers agree without talking and a cold prefix lands on a
stable replica. A hot prefix spills to another replica exactly when the holder's queue
costs more than the prefill the other replica would redo (by more than ``tie_tolerance_s``;
0 makes the rule exact). Unmeasured rates fall back to the configured defaults. ``choose`` raises ``ValueError`` on an empty candidate list.
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
        stats = view.stats
        return stats.num_queued_prefill_tokens / self.prefill_tokens_per_s(stats) + (
            stats.num_waiting + view.num_inflight
        ) * self.decode_step_s(stats)

    def predicted_ttft_s(
        self, view: ReplicaView, match: Match | None, num_prompt_tokens: int, miss_cost_factor: float = 1.0
    ) -> float:
        """``miss_cost_factor`` > 1 also charges the prefill a miss adds to that replica's queue
        (the delay it imposes on the requests behind it); 1 is the request's own TTFT."""
        stats = view.stats
        num_device_tokens = num_host_tokens = 0
        if match is not None:
            num_device_tokens = min(match.device_blocks * self.block_size, num_prompt_tokens)
            num_host_tokens = min(
                match.host_blocks * self.block_size, num_prompt_tokens - num_device_tokens
            )
        num_miss_tokens = num_prompt_tokens - num_device_tokens - num_host_tokens
        host_rate = stats.host_to_device_tokens_per_s or self.default_host_to_device_tokens_per_s
        return (
            self.queue_s(view)
            + miss_cost_factor * num_miss_tokens / self.prefill_tokens_per_s(stats)
            + num_host_tokens / host_rate
        )


def _check(replicas: Sequence[ReplicaView], num_prompt_tokens: int) -> None:
    if not replicas:
        raise ValueError("replicas must hold at least one candidate")
    if num_prompt_tokens < 0:
        raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")


def _matched(matches: Mapping[str, Match], replica_id: str) -> int:
    match = matches.get(replica_id)
    return 0 if match is None else match.num_blocks


class PrefixPolicy:
    """Minimum predicted TTFT; ties by longest match, then rendezvous on the first block."""

    name = "prefix"

    def __init__(self, config: RouterConfig) -> None:
        self.model = TTFTModel(config)
        self.tie_tolerance_s = config.tie_tolerance_s
        self.miss_cost_factor = config.miss_cost_factor

    def choose(self, block_hashes, num_prompt_tokens, replicas, matches) -> Decision:
        _check(replicas, num_prompt_tokens)
        scored = [
            (self.model.predicted_ttft_s(v, matches.get(v.replica_id), num_prompt_tokens, self.miss_cost_factor), v)
            for v in replicas
        ]
        best_s = min(score for score, _ in scored)
        tied = [v for score, v in scored if score <= best_s + self.tie_tolerance_s]
        longest = max(_matched(matches, v.replica_id) for v in tied)
        tied = [v for v in tied if _matched(matches, v.replica_id) == longest]
        if len(tied) == 1:
            view = tied[0]
            reason = "prefix" if longest > 0 else "load"
        else:
            # Equal cost and equal match: the least loaded, then rendezvous on the first block,
            # so a hot prefix held by several replicas spreads over them and a cold one lands
            # on a replica every router agrees on.
            least = min(_load(v) for v in tied)
            key = block_hashes[0] if block_hashes else b""
            chosen_id = rendezvous_pick(key, [v.replica_id for v in tied if _load(v) == least])
            view = next(v for v in tied if v.replica_id == chosen_id)
            any_match = any(_matched(matches, v.replica_id) for v in replicas)
            reason = "tie" if any_match else "cold"
        ttft_s = self.model.predicted_ttft_s(view, matches.get(view.replica_id), num_prompt_tokens)
        return Decision(view.replica_id, ttft_s, longest, reason)


def _load(view: ReplicaView) -> int:
    return view.stats.num_waiting + view.stats.num_running + view.num_inflight


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
