"""The load-only baseline policies: ``round_robin``, ``least_loaded``, ``pow2``.

Owns ``RoundRobinPolicy``, ``LeastLoadedPolicy`` and ``Pow2Policy`` behind ``router.policy``'s
interface; the simulator (``bench/sim/baselines.py``) runs these same classes, so simulated
and deployed baselines break ties the same way. They ignore matches for the choice but report
the chosen replica's matched blocks and its predicted TTFT, and ignore the request's LoRA
adapter (``lora_name``) altogether, its load included; every decision's reason is
``RoutingReason.BASELINE``. "Loaded" is ``router.policy.load_rank``: the replica's queued
prefill tokens, then its requests. Tie-breaks: round robin walks the replicas sorted by id;
least loaded takes the highest rendezvous weight of the first block among the least loaded;
pow2 keeps the first of its two seeded draws unless the second is strictly less loaded.
``choose`` raises ``ValueError`` on an empty candidate list.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Mapping, Sequence

from router.config import RouterConfig
from router.index_types import Match
from router.policy import (
    Decision,
    ReplicaView,
    RoutingReason,
    TTFTModel,
    check_request,
    load_rank,
    num_matched,
    rendezvous_weight,
)
from router.protocol import BlockHash


class _Baseline:
    """Shared plumbing of the load-only baselines: they ignore matches but report them."""

    name = "baseline"

    def __init__(self, config: RouterConfig) -> None:
        self.model = TTFTModel(config)

    def _pick(
        self, block_hashes: Sequence[BlockHash], replicas: Sequence[ReplicaView]
    ) -> ReplicaView:
        raise NotImplementedError

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        replicas: Sequence[ReplicaView],
        matches: Mapping[str, Match],
        *,
        lora_name: str | None = None,
    ) -> Decision:
        check_request(replicas, num_prompt_tokens)
        view = self._pick(block_hashes, replicas)
        match = matches.get(view.replica_id)
        ttft_s = self.model.predicted_ttft_s(view, match, num_prompt_tokens)
        matched = num_matched(matches, view.replica_id)
        return Decision(view.replica_id, ttft_s, matched, RoutingReason.BASELINE)


class RoundRobinPolicy(_Baseline):
    """Each replica in turn, in replica-id order."""

    name = "round_robin"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def _pick(
        self, block_hashes: Sequence[BlockHash], replicas: Sequence[ReplicaView]
    ) -> ReplicaView:
        with self._lock:
            turn = next(self._counter)
        return sorted(replicas, key=lambda v: v.replica_id)[turn % len(replicas)]


class LeastLoadedPolicy(_Baseline):
    """Fewest queued prefill tokens, then fewest requests; ties by rendezvous on the first
    block."""

    name = "least_loaded"

    def _pick(
        self, block_hashes: Sequence[BlockHash], replicas: Sequence[ReplicaView]
    ) -> ReplicaView:
        key = block_hashes[0] if block_hashes else b""
        return min(replicas, key=lambda v: (load_rank(v), -rendezvous_weight(key, v.replica_id)))


class Pow2Policy(_Baseline):
    """Power of two choices: the less loaded of two candidates drawn at random (``seed``)."""

    name = "pow2"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()

    def _pick(
        self, block_hashes: Sequence[BlockHash], replicas: Sequence[ReplicaView]
    ) -> ReplicaView:
        if len(replicas) == 1:
            return replicas[0]
        with self._lock:
            first, second = self._rng.sample(list(replicas), 2)
        return second if load_rank(second) < load_rank(first) else first
