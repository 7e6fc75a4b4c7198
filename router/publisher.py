"""KVEventPublisher: one replica's KV events and heartbeats to the index, off the step path.

Owns the replica side of the index protocol (docs/design.md, KV events: "publishing never blocks
an engine step"). The engine hands its drained batches to ``publish``, which only appends to
a bounded buffer; a daemon thread (or a caller of ``run_once``) applies them with
``apply_many``, heartbeats every ``heartbeat_interval_s``, and asks the engine to re-announce
(``on_stale``) when the index answers ``STALE``. The re-announce itself must come from the
engine's own step as a batch ``cleared`` + ``stored(everything cached)`` numbered in order,
so the publisher never reads the engine's cache from its thread.

How it fails: a full buffer drops its oldest batch (counted); the index sees the seq gap,
answers ``STALE`` and the replica re-announces. ``IndexUnavailableError`` from a bare
backend is logged and the pending batches are dropped the same way (wrap the index in
``FallbackIndex`` to also skip calls while it is down). ``on_stale`` is called once per
stale period and again every ``REANNOUNCE_RETRY_S`` while the index stays stale.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from router.index import PrefixIndex
from router.index_types import Clock, IndexUnavailableError
from router.liveness import ApplyOutcome
from router.protocol import KVEventBatch

logger = logging.getLogger(__name__)

# Batches buffered while the index is slow; one per engine step with changes, so this is
# ~10 s of steps at 100 steps/s. Beyond it the oldest are dropped and a re-announce follows.
MAX_PENDING_BATCHES = 1024
# A re-announce can itself be lost (dropped buffer, index restart); ask again this often.
REANNOUNCE_RETRY_S = 5.0


class KVEventPublisher:
    """Publishes one replica's batches and heartbeats; thread-safe ``publish``."""

    def __init__(
        self,
        index: PrefixIndex,
        replica_id: str,
        epoch: int,
        heartbeat_interval_s: float,
        on_stale: Callable[[], None] | None = None,
        max_pending_batches: int = MAX_PENDING_BATCHES,
        clock: Clock = time.monotonic,
    ) -> None:
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be positive, got {heartbeat_interval_s}")
        if max_pending_batches <= 0:
            raise ValueError(f"max_pending_batches must be positive, got {max_pending_batches}")
        self.index = index
        self.replica_id = replica_id
        self.epoch = epoch
        self.heartbeat_interval_s = heartbeat_interval_s
        self.on_stale = on_stale
        self._clock = clock
        self._pending: collections.deque[KVEventBatch] = collections.deque(
            maxlen=max_pending_batches
        )
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_heartbeat = 0.0
        self._stale_reported_at: float | None = None
        self.num_dropped_batches = 0
        self.num_applied_batches = 0

    def publish(self, batches: Sequence[KVEventBatch]) -> None:
        """Queue the engine's drained batches; never blocks on the index."""
        if not batches:
            return
        with self._lock:
            for batch in batches:
                if len(self._pending) == self._pending.maxlen:
                    self.num_dropped_batches += 1
                self._pending.append(batch)
        self._wake.set()

    def run_once(self) -> list[ApplyOutcome]:
        """Heartbeat if due, apply everything pending; returns the outcomes of the batches."""
        now = self._clock()
        with self._lock:
            batches = list(self._pending)
            self._pending.clear()
        try:
            if now >= self._next_heartbeat:
                self.index.heartbeat(self.replica_id, self.epoch)
                self._next_heartbeat = now + self.heartbeat_interval_s
            outcomes = self.index.apply_many(batches) if batches else []
        except IndexUnavailableError as exc:
            logger.warning("index unavailable, %d KV batches dropped: %s", len(batches), exc)
            self.num_dropped_batches += len(batches)
            return []
        self.num_applied_batches += sum(o == ApplyOutcome.APPLIED for o in outcomes)
        self._track_staleness(outcomes, now)
        return outcomes

    def _track_staleness(self, outcomes: list[ApplyOutcome], now: float) -> None:
        for outcome in outcomes:
            if outcome == ApplyOutcome.APPLIED:
                self._stale_reported_at = None
            elif outcome == ApplyOutcome.STALE:
                due = (
                    self._stale_reported_at is None
                    or now - self._stale_reported_at >= REANNOUNCE_RETRY_S
                )
                if due:
                    self._stale_reported_at = now
                    logger.info(
                        "index has a stale view of %s: asking to re-announce", self.replica_id
                    )
                    if self.on_stale is not None:
                        self.on_stale()

    # ------------------------------------------------------------------------- the thread
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"prefixserve-kv-publisher-{self.replica_id}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=self.heartbeat_interval_s)
            self._wake.clear()
            try:
                self.run_once()
            except Exception:  # a bug must not silently stop heartbeats
                logger.exception("KV event publisher of %s failed a round", self.replica_id)

    def close(self) -> None:
        """Stop the thread after one last round (pending batches are still applied)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
        self.run_once()
