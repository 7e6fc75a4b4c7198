"""What every request router of an application has in flight on each replica, shared.

Owns the cross-router view of in-flight requests. Each ingress replica runs its own request
router (``cluster.request_router``), and each tracks only the requests *it* sent
(``router.load.LoadTracker``); the replicas' routing stats show the others only about once a
second. Two routers deciding within that second each see a replica as idle and both send to
it: with two ingress replicas and three engine replicas, least-loaded routing left one
replica idle 14-32% of a run while another queued. Here each router publishes its tracker's
``LoadSnapshot``, and reads the others' beside every index lookup, so a decision sees what
every router sent, a round trip old instead of a stats period old.

- ``InflightBoard``: the shared state, plain Python. One ``LoadSnapshot`` per router,
  replaced by each report with a newer sequence number (reports of a router may arrive out of
  order: the actor is threaded) and dropped ``ttl_s`` after it arrived unless refreshed, so a
  router that died stops counting. ``peers(router_id)`` merges the other routers' snapshots.
- ``LocalBoardClient``: a router's client of an ``InflightBoard`` in the same process.
- ``ActorBoardClient``: a router's client of the board the application's index actor hosts
  (``cluster.index_actor.IndexActor``, with either index backend). ``changed()`` is cheap
  (sets an event); a daemon thread sends the newest snapshot, coalescing bursts (at most one
  per ``MIN_PUBLISH_INTERVAL_S``), and re-sends it every ``REFRESH_S`` so it does not expire
  (an empty one too: it says this router exists).

A router alone on its board (one ingress replica, the default) has nobody to tell and
nothing to read: when the board's answer says no other router reports, the client stops
sending per change (only the refreshes go) and answers ``peers`` with an empty snapshot
without a round trip for ``ALONE_RECHECK_S``, after which it asks again. So a second router
is seen within that long, and sees the first one's requests as of its last refresh (at most
``REFRESH_S`` old, like the replicas' stats) until the first one notices it too.

How it fails: an unreachable actor (dead, slow, not yet created) makes ``peers`` return
None after at most the lookup timeout (the router then decides on its own requests beside
the replicas' stats: ``router.load.replica_load`` prices the others from the stats), logged
once per outage; a failed publish is dropped, and the next change or refresh sends the
whole snapshot again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable

import ray

from router.load import LoadSnapshot

log = logging.getLogger("ray.serve")

BOARD_TTL_S = 10.0
"""A router's snapshot stops counting this long after it arrived unless refreshed."""
REFRESH_S = 3.0
"""A router re-sends a non-empty snapshot this often (well inside ``BOARD_TTL_S``)."""
ALONE_RECHECK_S = 1.0
"""A router that saw no other router on the board asks again after this long, not per
decision (module docstring)."""
MIN_PUBLISH_INTERVAL_S = 0.01
"""A router sends at most one snapshot per this many seconds; the changes in between go in
the next. A snapshot holds every request in flight, so at hundreds of decisions and first
outputs per second one per change would cost the ingress and the index actor more than the
routing it informs; 10 ms is far inside a stats period and a prefill."""


class InflightBoard:
    """Every router's in-flight snapshot; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._reports: dict[str, tuple[int, float, LoadSnapshot]] = {}
        """Router id -> (sequence number, expiry, snapshot)."""
        self.last_report_s: float | None = None
        """When (``clock``) the last report arrived; None before the first."""

    def report(self, router_id: str, seq: int, snapshot: LoadSnapshot, ttl_s: float) -> bool:
        """Replace ``router_id``'s snapshot unless a newer one (higher ``seq``) is already
        here. True when applied. An empty snapshot is kept like any other (with its sequence
        number, so a late older report stays out) until it expires."""
        now_s = self._clock()
        with self._lock:
            self.last_report_s = now_s
            held = self._reports.get(router_id)
            if held is not None and held[0] >= seq:
                return False
            self._reports[router_id] = (seq, now_s + ttl_s, snapshot)
            return True

    def peers(self, router_id: str) -> LoadSnapshot:
        """The other routers' requests per replica, merged oldest first; expired snapshots
        are dropped."""
        return self.view(router_id)[0]

    def view(self, router_id: str) -> tuple[LoadSnapshot, int]:
        """``peers(router_id)`` and how many other routers report here (an empty snapshot
        counts: that router is alive and reads the board)."""
        now_s = self._clock()
        with self._lock:
            for other in [r for r, (_, expiry_s, _) in self._reports.items() if expiry_s <= now_s]:
                del self._reports[other]
            others = [snap for r, (_, _, snap) in self._reports.items() if r != router_id]
        return LoadSnapshot().merged(*others), len(others)


class LocalBoardClient:
    """One router's client of an ``InflightBoard`` in this process: each change is reported
    at once (there is no round trip to save)."""

    def __init__(
        self,
        board: InflightBoard,
        snapshot: Callable[[], LoadSnapshot],
        router_id: str | None = None,
    ) -> None:
        self.router_id = router_id or uuid.uuid4().hex
        self._board = board
        self._snapshot = snapshot
        self._seq = itertools.count(1)

    def changed(self) -> None:
        self._board.report(self.router_id, next(self._seq), self._snapshot(), BOARD_TTL_S)

    def peers(self) -> LoadSnapshot:
        return self._board.peers(self.router_id)

    async def peers_async(self) -> LoadSnapshot:
        return self.peers()

    def close(self) -> None:
        self._board.report(self.router_id, next(self._seq), LoadSnapshot(), BOARD_TTL_S)


class ActorBoardClient:
    """One router's client of the board in the application's index actor.

    ``get_actor`` returns the actor handle (created if needed); ``lookup_timeout_s`` bounds
    ``peers``; ``router_id`` names what it publishes (the tracker's id: two routers of one
    process publishing one tracker count once, and never as each other's peer).
    Thread-safe."""

    def __init__(
        self,
        get_actor: Callable[[], object],
        snapshot: Callable[[], LoadSnapshot],
        lookup_timeout_s: float,
        router_id: str | None = None,
    ) -> None:
        self.router_id = router_id or uuid.uuid4().hex
        self._get_actor = get_actor
        self._snapshot = snapshot
        self._lookup_timeout_s = lookup_timeout_s
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._actor = None
        self._down = False
        self._alone = False
        """The board's last answer named no other router (module docstring); False until an
        answer says so."""
        self._recheck_at_s = 0.0
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._publish_loop, name="prefixserve-inflight-board", daemon=True
        )
        self._thread.start()

    def _handle(self):
        with self._lock:
            if self._actor is None:
                self._actor = self._get_actor()
            return self._actor

    def _failed(self, what: str, exc: BaseException) -> None:
        if isinstance(exc, ray.exceptions.RayActorError | ValueError):
            with self._lock:  # dead or not found: resolve it again next time
                self._actor = None
        if not self._down:
            self._down = True
            log.warning("in-flight board %s failed, routing on this router's own: %r", what, exc)

    def changed(self) -> None:
        """The tracker changed: the publisher thread sends the newest snapshot soon, unless
        no other router reads the board (then its next refresh carries it)."""
        if not self._alone:
            self._changed.set()

    def peers(self) -> LoadSnapshot | None:
        """The other routers' requests (None when the board does not answer); an empty
        snapshot without a round trip while this router is alone (module docstring)."""
        if self._still_alone():
            return LoadSnapshot()
        try:
            ref = self._handle().peer_view.remote(self.router_id)
            answer, num_others = ray.get(ref, timeout=self._lookup_timeout_s)
        except Exception as exc:  # any Ray failure: decide without the peers
            self._failed("lookup", exc)
            return None
        return self._answered(answer, num_others)

    async def peers_async(self) -> LoadSnapshot | None:
        """``peers`` awaited on the caller's event loop (no thread, no blocking ``ray.get``);
        a worker thread only while the actor is unresolved (resolving it blocks)."""
        if self._still_alone():
            return LoadSnapshot()
        actor = self._actor
        if actor is None:
            return await asyncio.to_thread(self.peers)
        try:
            ref = actor.peer_view.remote(self.router_id)
            answer, num_others = await asyncio.wait_for(ref, self._lookup_timeout_s)
        except Exception as exc:  # any Ray failure or the timeout: decide without the peers
            self._failed("lookup", exc)
            return None
        return self._answered(answer, num_others)

    def _still_alone(self) -> bool:
        """No other router reported at the last answer, and it is not time to ask again."""
        return self._alone and time.monotonic() < self._recheck_at_s

    def _answered(self, answer: LoadSnapshot, num_others: int) -> LoadSnapshot:
        """Notes that the board answered and whether other routers read it (module
        docstring); returns ``answer``."""
        if self._down:
            self._down = False
            log.warning("in-flight board reachable again")
        was_alone, self._alone = self._alone, num_others == 0
        if self._alone:
            self._recheck_at_s = time.monotonic() + ALONE_RECHECK_S
        elif was_alone:  # someone reads the board now: publish what is in flight
            log.info("in-flight board: %d other router(s); publishing every change", num_others)
            self._changed.set()
        return answer

    def _send(self, snapshot: LoadSnapshot) -> None:
        if not ray.is_initialized():  # this process left its cluster: nobody to tell, and a
            return  # call now would start a Ray instance of its own (Ray's auto-init)
        try:  # fire and forget: the sequence number orders what arrives
            self._handle().report_inflight.remote(
                self.router_id, next(self._seq), snapshot, BOARD_TTL_S
            )
        except Exception as exc:
            self._failed("report", exc)

    def _publish_loop(self) -> None:
        while not self._stop.is_set():
            self._changed.wait(REFRESH_S)  # a change (while not alone), or the refresh
            if self._stop.is_set():
                break
            self._changed.clear()
            self._send(self._snapshot())
            self._stop.wait(MIN_PUBLISH_INTERVAL_S)  # what changes meanwhile goes next

    def close(self) -> None:
        """Stop publishing and withdraw this router's snapshot (best effort)."""
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=1.0)
        self._send(LoadSnapshot())
