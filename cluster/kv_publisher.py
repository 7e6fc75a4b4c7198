"""The replica side of the prefix index: KV events and heartbeats, never on the step path.

Owns one asyncio task per engine replica. Every ``DRAIN_PERIOD_S`` while the engine is
producing events (backing off to ``IDLE_DRAIN_PERIOD_S`` while it is not) it drains the engine's
KV event batches (a deque pop, no lock held by the engine step), renumbers them into this
replica's own stream (``seq`` 0, 1, 2, ... under one ``epoch`` chosen at startup, the
wall clock in milliseconds, so a restarted replica always announces a newer epoch) and
hands them to ``router.publisher.KVEventPublisher``, whose thread talks to the index. The
stream opens with a re-announce: ``cleared`` + ``stored`` of everything held (nothing, for
a fresh engine), which makes the index drop whatever an older epoch left behind.

The task keeps a mirror of what the engine holds per tier, built from the same events it
forwards, so it can re-announce (``cleared`` + ``stored`` of the mirror, numbered in
order) without ever reading the engine's cache from another thread. It re-announces when
the index answers ``STALE`` (it missed batches), when the index comes back after being
unreachable, and when the index actor was re-created.

How it fails: a slow or dead index only delays or drops batches in the publisher thread;
the engine and this task never wait for it. An engine ``seq`` gap (its own buffer
overflowed because this task was starved) makes the mirror unreliable: it is logged, and
the index may over- or under-count this replica until the blocks turn over.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from router.index import FallbackIndex, PrefixIndex
from router.protocol import EventKind, KVEvent, KVEventBatch, Tier
from router.publisher import KVEventPublisher

log = logging.getLogger("ray.serve")

# Often enough that a sibling request rarely arrives before its prefix is indexed (the
# router's speculative entries cover that gap), rarely enough that the index calls stay a small
# share of a busy replica's CPU (each is a Ray actor call, on the replica and on the index).
DRAIN_PERIOD_S = 0.1
# Drains that find nothing double the wait up to this: an idle replica wakes once a second
# instead of ten times, and the first events after a pause wait at most this long (the
# router's speculative entries, which live for seconds, stand in for them meanwhile).
IDLE_DRAIN_PERIOD_S = 1.0
# A heartbeat every quarter of the timeout: three may be lost before the replica is dead.
HEARTBEATS_PER_TIMEOUT = 4


class KVStream:
    """Renumbers engine batches into one epoch's stream and mirrors what they leave held."""

    def __init__(self, replica_id: str, epoch: int) -> None:
        self.replica_id = replica_id
        self.epoch = epoch
        self.held: dict[Tier, set[bytes]] = {Tier.DEVICE: set(), Tier.HOST: set()}
        self._next_seq = 0
        self._last_engine_seq: int | None = None
        self.num_engine_gaps = 0

    def _batch(self, events: tuple[KVEvent, ...]) -> KVEventBatch:
        batch = KVEventBatch(self.replica_id, self._next_seq, events, replica_epoch=self.epoch)
        self._next_seq += 1
        return batch

    def reannounce(self) -> KVEventBatch:
        """``cleared`` + ``stored`` of everything held, as the stream's next batch."""
        events = [KVEvent(EventKind.CLEARED)]
        for tier in (Tier.DEVICE, Tier.HOST):
            if self.held[tier]:
                events.append(KVEvent(EventKind.STORED, tuple(self.held[tier]), tier))
        return self._batch(tuple(events))

    def translate(self, engine_batch: KVEventBatch) -> KVEventBatch:
        """The engine's batch, renumbered into this stream; updates the mirror."""
        last = self._last_engine_seq
        if last is not None and engine_batch.seq != last + 1:
            self.num_engine_gaps += 1
            log.warning(
                "engine KV batches %s..%s were lost before publishing; the index view of %s "
                "may be off until its blocks turn over",
                last + 1,
                engine_batch.seq - 1,
                self.replica_id,
            )
        self._last_engine_seq = engine_batch.seq
        for event in engine_batch.events:
            if event.kind == EventKind.STORED:
                self.held[event.tier].update(event.hashes)
            elif event.kind == EventKind.REMOVED:
                self.held[event.tier].difference_update(event.hashes)
            else:
                for held in self.held.values():
                    held.clear()
        return self._batch(engine_batch.events)


def next_drain_period_s(period_s: float, found: bool) -> float:
    """The wait before the next drain: ``DRAIN_PERIOD_S`` after one that found batches, else
    twice the last wait, at most ``IDLE_DRAIN_PERIOD_S``."""
    if found:
        return DRAIN_PERIOD_S
    return min(2 * period_s, IDLE_DRAIN_PERIOD_S)


class ReplicaKVPublisher:
    """Drains one engine's KV events into the index from an asyncio task."""

    def __init__(
        self,
        drain: Callable[[], list[KVEventBatch]],
        index: PrefixIndex,
        replica_id: str,
        heartbeat_timeout_s: float,
        retry_interval_s: float,
        epoch: int | None = None,
    ) -> None:
        self._drain = drain
        self._raw_index = index
        self.index = FallbackIndex(index, retry_interval_s)
        self.stream = KVStream(replica_id, epoch if epoch is not None else time.time_ns() // 10**6)
        self._reannounce_wanted = threading.Event()
        self._reannounce_wanted.set()  # the stream opens with one
        self.publisher = KVEventPublisher(
            self.index,
            replica_id,
            self.stream.epoch,
            heartbeat_interval_s=heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT,
            on_stale=self._reannounce_wanted.set,
        )
        self._task: asyncio.Task | None = None
        self._was_available = True
        self._generation = getattr(index, "generation", 0)

    def start(self) -> None:
        """Starts the publisher thread and the drain task on the running loop."""
        self.publisher.start()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _index_changed(self) -> bool:
        """True when the index came back or was re-created: it may hold nothing of ours."""
        changed = False
        available = self.index.available
        if available and not self._was_available:
            changed = True
        self._was_available = available
        generation = getattr(self._raw_index, "generation", 0)
        if generation > max(self._generation, 1):
            changed = True
        self._generation = max(self._generation, generation)
        return changed

    def drain_once(self) -> list[KVEventBatch]:
        """Drain, renumber and queue; returns the batches queued (for tests and logs): empty
        when the engine had none and no re-announce was due."""
        batches = [self.stream.translate(b) for b in self._drain()]
        if self._index_changed():
            self._reannounce_wanted.set()
        if self._reannounce_wanted.is_set():
            self._reannounce_wanted.clear()
            batches.append(self.stream.reannounce())
        self.publisher.publish(batches)
        return batches

    async def _run(self) -> None:
        period_s = DRAIN_PERIOD_S
        while True:
            try:
                found = bool(self.drain_once())
            except Exception:  # a bug costs routing quality, never the replica
                log.exception("KV event drain of %s failed", self.stream.replica_id)
                found = False
            period_s = next_drain_period_s(period_s, found)
            await asyncio.sleep(period_s)

    async def close(self) -> None:
        """Stops the task and the thread (pending batches get one last try)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await asyncio.to_thread(self.publisher.close)
