"""EmbeddedIndex: the default prefix index, plain dicts and sets behind one lock.

Owns an in-process view of which block hashes each replica holds, per tier, plus the
speculative entries the router records for requests it just sent. Needs no extra service;
the cluster hosts one instance in a Ray actor so every router process shares it, which is
why every method takes and returns plain picklable values and ``__getstate__`` drops the
lock.

Memory is bounded by what live replicas hold: a dead replica's entries stop counting at
the first lookup after its heartbeat deadline and are freed by the next ``sweep`` (run on
every heartbeat). Expired speculative entries are pruned when a replica's table grows.
Nothing here does I/O, so nothing here raises ``IndexUnavailableError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.index_types import Clock, Match, ReplicaId
from router.liveness import (
    Action,
    ApplyOutcome,
    StreamState,
    decide,
    heartbeat_state,
    outcome_of,
)
from router.protocol import BlockHash, EventKind, KVEventBatch, Tier

# Prune a replica's expired speculative entries once it tracks this many, then again only
# when the table has doubled since: a prune is O(entries), so this keeps
# ``record_speculative`` amortized O(1) even when many entries are still live.
SPECULATIVE_PRUNE_MIN_ENTRIES = 4096


Change = tuple
"""One change an index made, as ``EmbeddedIndex.replay`` takes it: ``("apply", batch, now)``,
``("heartbeat", replica_id, epoch, now)``, ``("speculate", replica_id, block_hashes, expiry,
now)``, ``("remove", replica_id)`` or ``("sweep", now)``; ``now`` is the clock reading the
change used (``router/index_journal.py`` records them)."""


@dataclass(frozen=True)
class IndexState:
    """Everything an ``EmbeddedIndex`` holds, as plain values (``export_state``)."""

    entries: dict[ReplicaId, tuple[set, set, dict, int]]
    """Per replica: device hashes, host hashes, speculative hash -> expiry, prune mark."""
    streams: dict[ReplicaId, StreamState]
    deadline: dict[ReplicaId, float]


@dataclass
class _ReplicaEntries:
    device: set[BlockHash] = field(default_factory=set)
    host: set[BlockHash] = field(default_factory=set)
    speculative: dict[BlockHash, float] = field(default_factory=dict)
    """Block hash -> expiry time (clock seconds)."""
    prune_at_entries: int = SPECULATIVE_PRUNE_MIN_ENTRIES

    def clear(self) -> None:
        self.device.clear()
        self.host.clear()
        self.speculative.clear()


class EmbeddedIndex:
    """Thread-safe in-process ``PrefixIndex``."""

    def __init__(self, heartbeat_timeout_s: float = 10.0, clock: Clock = time.time) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[ReplicaId, _ReplicaEntries] = {}
        self._streams: dict[ReplicaId, StreamState] = {}
        self._deadline: dict[ReplicaId, float] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- events
    def apply(self, batch: KVEventBatch) -> ApplyOutcome:
        with self._lock:
            return self._apply_noted(batch, self._clock())

    def apply_many(self, batches: Sequence[KVEventBatch]) -> list[ApplyOutcome]:
        with self._lock:
            now = self._clock()
            return [self._apply_noted(batch, now) for batch in batches]

    def _changed(self, change: Change) -> None:
        """Hears each change the public methods make, under the lock, before it is made;
        nothing here (``router.index_journal.JournaledIndex`` keeps them)."""

    def _apply_noted(self, batch: KVEventBatch, now: float) -> ApplyOutcome:
        outcome = self._apply_locked(batch, now)
        if outcome != ApplyOutcome.IGNORED:  # an ignored batch changed nothing
            self._changed(("apply", batch, now))
        return outcome

    def _apply_locked(self, batch: KVEventBatch, now: float) -> ApplyOutcome:
        action, new_state = decide(self._streams.get(batch.replica_id), batch)
        if action == Action.IGNORE:
            return ApplyOutcome.IGNORED
        self._streams[batch.replica_id] = new_state
        self._deadline[batch.replica_id] = now + self.heartbeat_timeout_s
        entries = self._entries.setdefault(batch.replica_id, _ReplicaEntries())
        if action in (Action.DROP_THEN_APPLY, Action.DROP_THEN_STALE):
            entries.clear()
        if action in (Action.APPLY, Action.DROP_THEN_APPLY):
            for event in batch.events:
                tier_set = entries.host if event.tier == Tier.HOST else entries.device
                if event.kind == EventKind.STORED:
                    tier_set.update(event.hashes)
                elif event.kind == EventKind.REMOVED:
                    tier_set.difference_update(event.hashes)
                else:
                    entries.device.clear()
                    entries.host.clear()
        return outcome_of(action)

    # --------------------------------------------------------------------------- lookups
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        if not block_hashes:
            return {}
        with self._lock:
            now = self._clock()
            result: dict[ReplicaId, Match] = {}
            for replica_id, entries in self._entries.items():
                if self._deadline.get(replica_id, 0.0) <= now:
                    continue
                match = _match_one(entries, block_hashes, now)
                if match is not None:
                    result[replica_id] = match
            return result

    def record_speculative(
        self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        self.record_speculative_many([(replica_id, block_hashes)], ttl_s)

    def record_speculative_many(
        self, entries: Sequence[tuple[ReplicaId, Sequence[BlockHash]]], ttl_s: float
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        with self._lock:
            now = self._clock()
            for replica_id, block_hashes in entries:
                hashes = tuple(block_hashes)
                self._changed(("speculate", replica_id, hashes, now + ttl_s, now))
                self._speculate_locked(replica_id, hashes, now + ttl_s, now)

    def _speculate_locked(
        self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash], expiry: float, now: float
    ) -> None:
        entries = self._entries.get(replica_id)
        if entries is None:
            return  # never heard of: it could not count anyway, and nothing would free it
        for block_hash in block_hashes:
            entries.speculative[block_hash] = expiry
        if len(entries.speculative) > entries.prune_at_entries:
            entries.speculative = {h: t for h, t in entries.speculative.items() if t > now}
            entries.prune_at_entries = max(
                SPECULATIVE_PRUNE_MIN_ENTRIES, 2 * len(entries.speculative)
            )

    # -------------------------------------------------------------------------- liveness
    def heartbeat(self, replica_id: ReplicaId, epoch: int, now: float | None = None) -> bool:
        with self._lock:
            now = self._clock() if now is None else now
            self._changed(("heartbeat", replica_id, epoch, now))  # it sweeps even if refused
            return self._heartbeat_locked(replica_id, epoch, now)

    def _heartbeat_locked(self, replica_id: ReplicaId, epoch: int, now: float) -> bool:
        self._sweep_locked(now)
        state = self._streams.get(replica_id)
        if state is not None and epoch < state.epoch:
            return False  # a late heartbeat of an engine that has since restarted
        drop, new_state = heartbeat_state(state, epoch)
        if drop and replica_id in self._entries:
            self._entries[replica_id].clear()
        self._streams[replica_id] = new_state
        self._entries.setdefault(replica_id, _ReplicaEntries())
        self._deadline[replica_id] = now + self.heartbeat_timeout_s
        return True

    def replicas(self) -> list[ReplicaId]:
        with self._lock:
            now = self._clock()
            return sorted(r for r, deadline in self._deadline.items() if deadline > now)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        with self._lock:
            self._changed(("remove", replica_id))
            self._forget_locked(replica_id)

    def sweep(self, now: float | None = None) -> list[ReplicaId]:
        with self._lock:
            now = self._clock() if now is None else now
            self._changed(("sweep", now))
            return self._sweep_locked(now)

    def _sweep_locked(self, now: float) -> list[ReplicaId]:
        dead = [r for r, deadline in self._deadline.items() if deadline <= now]
        for replica_id in dead:
            self._forget_locked(replica_id)
        return dead

    # ------------------------------------------------------------- copies (index_journal.py)
    def export_state(self) -> IndexState:
        """A copy of everything the index holds, for ``import_state`` elsewhere."""
        with self._lock:
            return self._export_locked()

    def _export_locked(self) -> IndexState:
        entries = {
            replica_id: (set(e.device), set(e.host), dict(e.speculative), e.prune_at_entries)
            for replica_id, e in self._entries.items()
        }
        return IndexState(entries, dict(self._streams), dict(self._deadline))

    def import_state(self, state: IndexState) -> None:
        """Replaces what the index holds with ``state`` (``export_state`` of another)."""
        with self._lock:
            self._entries = {
                replica_id: _ReplicaEntries(set(device), set(host), dict(speculative), prune_at)
                for replica_id, (device, host, speculative, prune_at) in state.entries.items()
            }
            self._streams = dict(state.streams)
            self._deadline = dict(state.deadline)

    def replay(self, changes: Sequence[Change]) -> None:
        """Makes the changes another index made, each with the clock reading it used
        (``Change``); the same changes on the same state give the same state."""
        with self._lock:
            for change in changes:
                kind, args = change[0], change[1:]
                if kind == "apply":
                    batch, now = args
                    self._apply_locked(batch, now)
                elif kind == "heartbeat":
                    replica_id, epoch, now = args
                    self._heartbeat_locked(replica_id, epoch, now)
                elif kind == "speculate":
                    replica_id, block_hashes, expiry, now = args
                    self._speculate_locked(replica_id, block_hashes, expiry, now)
                elif kind == "remove":
                    self._forget_locked(args[0])
                elif kind == "sweep":
                    self._sweep_locked(args[0])
                else:
                    raise ValueError(f"unknown index change {kind!r}")

    def _forget_locked(self, replica_id: ReplicaId) -> None:
        # Forgetting the stream too means a replica that comes back must re-announce.
        self._entries.pop(replica_id, None)
        self._streams.pop(replica_id, None)
        self._deadline.pop(replica_id, None)


def _match_one(
    entries: _ReplicaEntries, block_hashes: Sequence[BlockHash], now: float
) -> Match | None:
    device, host, speculative = entries.device, entries.host, entries.speculative
    num_blocks = len(block_hashes)
    i = 0
    while i < num_blocks:
        h = block_hashes[i]
        if h not in device and speculative.get(h, 0.0) <= now:
            break
        i += 1
    num_device = i
    while i < num_blocks:
        h = block_hashes[i]
        if h not in host and h not in device and speculative.get(h, 0.0) <= now:
            break
        i += 1
    if i == 0:
        return None
    return Match(device_blocks=num_device, host_blocks=i - num_device)
