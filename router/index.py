"""The prefix index contract: which live replica holds how many leading blocks of a request.

Owns the ``PrefixIndex`` protocol, the ``FallbackIndex`` wrapper and the ``make_index``
factory. Its value types (``Match``, ``IndexUnavailableError``, ``ReplicaId``, ``Clock``) live
in ``router/index_types.py``: import them from there, as the backends do. Two
backends implement the protocol: ``embedded_index.EmbeddedIndex`` (in-process, the default;
the cluster hosts one instance in a Ray actor) and ``redis_index.RedisIndex``.

Invariants every backend keeps (tests/router/test_index_contract.py checks them all):

* ``match`` counts only *leading, consecutive* blocks, only for live replicas (a heartbeat
  within ``heartbeat_timeout_s``); a dead replica stops counting at once and its entries are
  removed by the next sweep.
* A replica's stream follows ``liveness.decide``: a gap or a new epoch drops its entries
  until it re-announces.
* Every argument and return value is a plain picklable value, so a backend can sit behind a
  Ray actor or any RPC.

How it fails: a backend whose store is unreachable raises ``IndexUnavailableError`` quickly;
``FallbackIndex`` turns that into "no matches" (routing by load alone), logs once per outage
and probes again every ``redis_retry_interval_s`` until the store answers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from router.config import RouterConfig
from router.index_types import Clock, IndexUnavailableError, Match, ReplicaId
from router.liveness import ApplyOutcome
from router.metrics import RouterMetrics
from router.protocol import BlockHash, KVEventBatch

logger = logging.getLogger(__name__)

__all__ = ["PrefixIndex", "FallbackIndex", "make_index"]


@runtime_checkable
class PrefixIndex(Protocol):
    """Where prefixes live. Implementations are thread-safe."""

    def apply(self, batch: KVEventBatch) -> ApplyOutcome: ...

    def apply_many(self, batches: Sequence[KVEventBatch]) -> list[ApplyOutcome]: ...

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        """Live replicas holding at least the first block; absent replicas hold nothing."""
        ...

    def heartbeat(self, replica_id: ReplicaId, epoch: int, now: float | None = None) -> bool:
        """Mark the replica alive; a newer epoch drops its old entries. False if ignored."""
        ...

    def remove_replica(self, replica_id: ReplicaId) -> None: ...

    def replicas(self) -> list[ReplicaId]:
        """Live replica ids, sorted."""
        ...

    def record_speculative(
        self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        """Count ``block_hashes`` as held on the replica's device for ``ttl_s`` seconds."""
        ...

    def record_speculative_many(
        self, entries: Sequence[tuple[ReplicaId, Sequence[BlockHash]]], ttl_s: float
    ) -> None:
        """``record_speculative`` of each (replica, block hashes) entry, in order, in one
        call (one round trip where the store is remote)."""
        ...

    def sweep(self, now: float | None = None) -> list[ReplicaId]:
        """Remove the entries of dead replicas; returns the ids removed."""
        ...


SLOW_ANSWERS_BEFORE_DOWN = 3
"""Timeouts in a row that count the store as down. A store that refuses or fails is down at
its first failure; one that answers too slowly may only be busy (a crowded host's scheduling
stalls last tens of milliseconds), so a single late answer costs its own call, not a
``retry_interval_s`` of routing by load alone. A store that hangs costs this many timeouts."""


class FallbackIndex:
    """Wraps a backend so that an unreachable store degrades routing instead of failing it.

    The store is down after a failure that is not a timeout, or after
    ``SLOW_ANSWERS_BEFORE_DOWN`` timeouts in a row; each failed call returns its default.
    While the store is down, calls skip it (no timeout paid per request) except one probe
    per ``retry_interval_s``. Events that arrive meanwhile are dropped; the sequence gap
    they leave makes the store mark those replicas stale once it is back, which asks them
    to re-announce.
    """

    def __init__(
        self,
        inner: PrefixIndex,
        retry_interval_s: float,
        metrics: RouterMetrics | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.inner = inner
        self.retry_interval_s = retry_interval_s
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._next_probe: float = 0.0
        self._timeouts_in_a_row = 0

    @property
    def available(self) -> bool:
        return self._down_since is None

    def _should_try(self) -> bool:
        with self._lock:
            if self._down_since is None:
                return True
            now = self._clock()
            if now < self._next_probe:
                return False
            self._next_probe = now + self.retry_interval_s
            return True

    def _failed(self, exc: IndexUnavailableError) -> None:
        with self._lock:
            self._timeouts_in_a_row = self._timeouts_in_a_row + 1 if exc.timed_out else 0
            slow_only = 0 < self._timeouts_in_a_row < SLOW_ANSWERS_BEFORE_DOWN
            if self._down_since is None and not slow_only:
                self._down_since = self._clock()
                self._next_probe = self._down_since + self.retry_interval_s
                logger.warning("prefix index unavailable, routing by load alone: %s", exc)
        self.metrics.record_index_error()

    def _succeeded(self) -> None:
        self._timeouts_in_a_row = 0
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is not None:
                logger.warning(
                    "prefix index reachable again after %.1f s",
                    self._clock() - self._down_since,
                )
                self._down_since = None

    def _call(self, fn: Callable, *args, default):
        if not self._should_try():
            return default
        try:
            result = fn(*args)
        except IndexUnavailableError as exc:
            self._failed(exc)
            return default
        self._succeeded()
        return result

    def match_or_none(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match] | None:
        """Matches, or ``None`` when the store is unavailable (the caller routes by load)."""
        return self._call(self.inner.match, block_hashes, default=None)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        return self.match_or_none(block_hashes) or {}

    async def match_or_none_async(
        self, block_hashes: Sequence[BlockHash]
    ) -> dict[ReplicaId, Match] | None:
        """``match_or_none`` without blocking the caller's event loop: awaited on it when the
        store has a ``match_async`` (a router's copy of the index actor's index,
        ``cluster.index_mirror.MirroredIndex``: no round trip, no thread),
        else ``match_or_none`` in a worker thread."""
        match_async = getattr(self.inner, "match_async", None)
        if match_async is None:
            return await asyncio.to_thread(self.match_or_none, block_hashes)
        if not self._should_try():
            return None
        try:
            result = await match_async(block_hashes)
        except IndexUnavailableError as exc:
            self._failed(exc)
            return None
        self._succeeded()
        return result

    def apply(self, batch: KVEventBatch) -> ApplyOutcome:
        return self._call(self.inner.apply, batch, default=ApplyOutcome.IGNORED)

    def apply_many(self, batches: Sequence[KVEventBatch]) -> list[ApplyOutcome]:
        default = [ApplyOutcome.IGNORED] * len(batches)
        return self._call(self.inner.apply_many, batches, default=default)

    def heartbeat(self, replica_id: ReplicaId, epoch: int, now: float | None = None) -> bool:
        return self._call(self.inner.heartbeat, replica_id, epoch, now, default=False)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        self._call(self.inner.remove_replica, replica_id, default=None)

    def replicas(self) -> list[ReplicaId]:
        return self._call(self.inner.replicas, default=[])

    def record_speculative(
        self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        self._call(self.inner.record_speculative, replica_id, block_hashes, ttl_s, default=None)

    def record_speculative_many(
        self, entries: Sequence[tuple[ReplicaId, Sequence[BlockHash]]], ttl_s: float
    ) -> None:
        self._call(self.inner.record_speculative_many, entries, ttl_s, default=None)

    def sweep(self, now: float | None = None) -> list[ReplicaId]:
        return self._call(self.inner.sweep, now, default=[])


def make_index(config: RouterConfig, model_id: str, clock: Clock = time.time) -> PrefixIndex:
    """The backend ``config.index_backend`` names (Redis keys are namespaced by model_id)."""
    if config.index_backend == "redis":
        from router.redis_index import RedisIndex

        return RedisIndex(
            config.redis_url,
            model_id,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            socket_timeout_s=config.redis_socket_timeout_s,
            write_timeout_s=config.redis_write_timeout_s,
            speculative_bucket_s=config.speculative_ttl_s,
            clock=clock,
        )
    from router.embedded_index import EmbeddedIndex

    return EmbeddedIndex(heartbeat_timeout_s=config.heartbeat_timeout_s, clock=clock)
