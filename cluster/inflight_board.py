"""What every request router of an application has in flight on each replica, shared.

Owns the cross-router view of in-flight requests. Each ingress replica runs its own request
router (``cluster.request_router``), and each tracks only the requests *it* sent
(``router.load.LoadTracker``); the replicas' routing stats show the others only about once a
second. Two routers deciding within that second each see a replica as idle and both send to
it: with two ingress replicas and three engine replicas, least-loaded routing left one
replica idle 14-32% of a run while another queued. Here each router publishes its tracker's
``LoadSnapshot`` and reads the others', so a decision sees what every router sent, a sync
period old (``cluster/index_mirror.py``) instead of a stats period old.

- ``InflightBoard``: the shared state, plain Python. One ``LoadSnapshot`` per router,
  replaced by each report with a newer sequence number (reports of a router may arrive out of
  order: the actor is threaded) and dropped ``ttl_s`` after it arrived unless refreshed, so a
  router that died stops counting. ``view(router_id)`` merges the other routers' snapshots
  and counts them.
- ``LocalBoardClient``: a router's client of an ``InflightBoard`` in the same process (a
  router driven without Ray): reports each change and reads the board directly.
- ``ActorBoardClient``: a router's publisher to the board the application's index actor
  hosts (``cluster.index_actor.IndexActor``, with either index backend). ``changed()`` is
  cheap (sets an event); a daemon thread sends the newest snapshot, coalescing bursts (at
  most one per ``MIN_PUBLISH_INTERVAL_S``), and re-sends it every ``REFRESH_S`` so it does
  not expire (an empty one too: it says this router exists). The router reads the others'
  through its ``ActorMirror``, which tells this client how many other routers there are
  (``note_peers``).

A router alone on its board (one ingress replica, the default) has nobody to tell: while the
last sync counted no other router, the client sends no snapshot per change, only the
refreshes. So a second router is seen within a sync, and sees the first one's requests as
of its last refresh (at most ``REFRESH_S`` old, like the replicas' stats) until the first
one's next sync notices it too.

How it fails: a failed publish is logged once per outage and dropped; the next change or
refresh sends the whole snapshot again.
"""

from __future__ import annotations

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

    def close(self) -> None:
        self._board.report(self.router_id, next(self._seq), LoadSnapshot(), BOARD_TTL_S)


class ActorBoardClient:
    """One router's publisher to the board in the application's index actor.

    ``get_actor`` returns the actor handle (created if needed); ``router_id`` names what it
    publishes (the tracker's id: two routers of one process publishing one tracker count
    once, and never as each other's peer). Thread-safe."""

    def __init__(
        self,
        get_actor: Callable[[], object],
        snapshot: Callable[[], LoadSnapshot],
        router_id: str | None = None,
    ) -> None:
        self.router_id = router_id or uuid.uuid4().hex
        self._get_actor = get_actor
        self._snapshot = snapshot
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._actor = None
        self._down = False
        self._alone = False
        """The last sync counted no other router (module docstring); False until one says so."""
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

    def note_peers(self, num_others: int) -> None:
        """How many other routers the board counted at the last sync: with none, changes wait
        for the refresh; when one appears, what is in flight goes to the board at once."""
        was_alone, self._alone = self._alone, num_others == 0
        if was_alone and not self._alone:
            log.info("in-flight board: %d other router(s); publishing every change", num_others)
            self._changed.set()

    def _send(self, snapshot: LoadSnapshot) -> None:
        if not ray.is_initialized():  # this process left its cluster: nobody to tell, and a
            return  # call now would start a Ray instance of its own (Ray's auto-init)
        try:  # fire and forget: the sequence number orders what arrives
            self._handle().report_inflight.remote(
                self.router_id, next(self._seq), snapshot, BOARD_TTL_S
            )
        except Exception as exc:
            self._failed("report", exc)
            return
        if self._down:
            self._down = False
            log.warning("in-flight board reachable again")

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
