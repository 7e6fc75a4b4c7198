"""A request router's copy of what the index actor holds, read without a round trip.

Owns how a router reads the application's ``IndexActor`` (``cluster/index_actor.py``): the
embedded prefix index and the other routers' in-flight requests (the in-flight board).
Asking the actor on every decision puts a round trip into each one, and at dozens of
replicas on a busy node that round trip is most of the decision's time and the actor the
first thing to saturate. Instead ``ActorMirror`` runs one daemon thread that calls the
actor's ``sync`` every ``SYNC_PERIOD_S`` while the router is deciding (every
``IDLE_SYNC_PERIOD_S`` after ``ACTIVE_WINDOW_S`` without a decision) and keeps:

- a copy of the embedded index (``router.index_journal.IndexMirror``: the actor's journal
  replayed, or a whole copy when the journal no longer reaches back or the actor was
  re-created); ``MirroredIndex`` is the router's ``PrefixIndex`` over it, its lookups local
  and its writes (speculative entries, replicas removed) sent to the actor as before, a
  speculative entry also written into the copy at once, so the router's own decisions show
  in its next lookup;
- the other routers' requests per replica, which the router prices beside its own
  (``router.load``), and how many other routers there are, which the router's board client
  uses to skip publishing while it is alone (``cluster.inflight_board``).

Both are at most one sync period old while requests flow; the router's own decisions of
that period count through its ``RecentDecisions`` and its load tracker, so what the copy
lags behind is the other routers' and the replicas' news of the last period.

How it fails: a sync that fails or times out is logged once per outage and retried next
period (an actor not found is looked up again). A copy whose last sync is older than
``STALE_AFTER_S`` stops answering: ``match`` raises ``IndexUnavailableError`` (the router's
``FallbackIndex`` then routes by load alone) and ``peers`` returns None (the router prices
the other routers from the replicas' stats).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import ray

from router.config import RouterConfig
from router.index_journal import IndexMirror
from router.index_types import IndexUnavailableError, Match, ReplicaId
from router.liveness import ApplyOutcome
from router.load import LoadSnapshot
from router.protocol import BlockHash, KVEventBatch

log = logging.getLogger("ray.serve")

SYNC_PERIOD_S = 0.1
"""How often a deciding router copies the actor's news: the staleness of what it reads."""
IDLE_SYNC_PERIOD_S = 1.0
"""How often an idle router copies them (few change meanwhile, and each sync costs CPU)."""
ACTIVE_WINDOW_S = 2.0
"""A router that read its copy within this long is deciding: it syncs every period."""
STALE_AFTER_S = 3.0
"""A copy not refreshed for this long stops answering (module docstring)."""


class ActorMirror:
    """One router's copy of the index actor's index (when ``with_index``) and board;
    thread-safe. ``get_actor`` returns the actor handle (created if needed); ``router_id``
    is the router's board id (its own requests are not among the peers); ``on_peers``
    hears how many other routers report after each sync."""

    def __init__(
        self,
        get_actor: Callable[[], object],
        config: RouterConfig,
        router_id: str,
        *,
        with_index: bool,
        on_peers: Callable[[int], None] = lambda num_others: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router_id = router_id
        self.index = IndexMirror(config.heartbeat_timeout_s) if with_index else None
        self._get_actor = get_actor
        self._on_peers = on_peers
        self._clock = clock
        self._actor = None
        self._peers: LoadSnapshot | None = None
        self._num_others: int | None = None
        self._synced_at_s: float | None = None
        self._created_at_s = clock()
        self._last_read_s = self._created_at_s
        self._down = False
        self._sync_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._sync_loop, name="prefixserve-index-mirror", daemon=True
        )
        self._thread.start()

    # -------------------------------------------------------------------------- reading
    def fresh(self) -> bool:
        """The copy was refreshed within ``STALE_AFTER_S`` (or the mirror is younger)."""
        since_s = self._synced_at_s if self._synced_at_s is not None else self._created_at_s
        return self._clock() - since_s <= STALE_AFTER_S

    def _read(self) -> None:
        now_s = self._clock()
        idle = now_s - self._last_read_s > ACTIVE_WINDOW_S
        self._last_read_s = now_s
        if idle:  # the copy may be an idle period old: refresh it now, not a period from now
            self._wake.set()

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        """The copy's matches; ``IndexUnavailableError`` when it is stale."""
        self._read()
        if self.index is None:
            raise ValueError("this mirror copies no index")
        if not self.fresh():
            raise IndexUnavailableError(f"the index copy is over {STALE_AFTER_S:.0f} s old")
        return self.index.match(block_hashes)

    def peers(self) -> LoadSnapshot | None:
        """The other routers' requests as of the last sync; None when stale or not yet had."""
        self._read()
        return self._peers if self.fresh() else None

    def alone(self) -> bool:
        """The last sync, fresh, counted no other router: none reads what this one writes."""
        return self._num_others == 0 and self._synced_at_s is not None and self.fresh()

    # -------------------------------------------------------------------------- syncing
    def _handle(self):
        if self._actor is None:
            self._actor = self._get_actor()
        return self._actor

    def sync_once(self) -> bool:
        """One sync with the actor; False when it failed (logged once per outage). One at a
        time: an answer is replayed onto the cursor it was asked from."""
        if not ray.is_initialized():  # this process left its cluster: a call would start one
            return False
        with self._sync_lock:
            return self._sync_locked()

    def _sync_locked(self) -> bool:
        mirror = self.index
        try:
            ref = self._handle().sync.remote(
                None if mirror is None else mirror.instance_id,
                None if mirror is None else mirror.cursor,
                self.router_id,
                mirror is not None,
            )
            answer, peers, num_others = ray.get(ref, timeout=STALE_AFTER_S)
        except Exception as exc:  # any Ray failure or the timeout: try again next period
            if isinstance(exc, ray.exceptions.RayActorError | ValueError):
                self._actor = None  # dead or not found: look it up again
            if not self._down:
                self._down = True
                log.warning("index actor sync failed, its copy ages until it answers: %r", exc)
            return False
        if mirror is not None and answer is not None:
            mirror.catch_up(answer)
        self._peers = peers
        self._num_others = num_others
        self._synced_at_s = self._clock()
        if self._down:
            self._down = False
            log.warning("index actor sync answers again")
        self._on_peers(num_others)
        return True

    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except Exception:  # a bug must not end the thread and freeze the copy silently
                log.exception("index mirror sync")
            active = self._clock() - self._last_read_s <= ACTIVE_WINDOW_S
            self._wake.wait(SYNC_PERIOD_S if active else IDLE_SYNC_PERIOD_S)
            self._wake.clear()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=1.0)


class MirroredIndex:
    """The router's ``PrefixIndex`` over an ``ActorMirror``: lookups read the copy, writes
    go to the actor through ``writer`` (``cluster.index_actor.ActorIndexClient``).

    A speculative entry goes into the copy at once and to the actor only while another
    router may read it (``ActorMirror.alone``): a router alone would pay an actor call per
    burst of decisions for entries only it reads, from its copy. A router that appears later
    sees the prefixes when the replicas' KV events report them (a prefill later)."""

    def __init__(self, mirror: ActorMirror, writer) -> None:
        if mirror.index is None:
            raise ValueError("MirroredIndex needs a mirror that copies the index")
        self.mirror = mirror
        self.writer = writer

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        return self.mirror.match(block_hashes)

    async def match_async(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        """``match``: no round trip, so nothing to await."""
        return self.mirror.match(block_hashes)

    def record_speculative(
        self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        self.record_speculative_many([(replica_id, block_hashes)], ttl_s)

    def record_speculative_many(
        self, entries: Sequence[tuple[ReplicaId, Sequence[BlockHash]]], ttl_s: float
    ) -> None:
        self.mirror.index.record_speculative_many(entries, ttl_s)
        if not self.mirror.alone():
            self.writer.record_speculative_many(entries, ttl_s)

    def apply(self, batch: KVEventBatch) -> ApplyOutcome:
        return self.writer.apply(batch)

    def apply_many(self, batches: Sequence[KVEventBatch]) -> list[ApplyOutcome]:
        return self.writer.apply_many(batches)

    def heartbeat(self, replica_id: ReplicaId, epoch: int, now: float | None = None) -> bool:
        return self.writer.heartbeat(replica_id, epoch, now)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        self.writer.remove_replica(replica_id)

    def replicas(self) -> list[ReplicaId]:
        return self.mirror.index.replicas()

    def sweep(self, now: float | None = None) -> list[ReplicaId]:
        return self.writer.sweep(now)
