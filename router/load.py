"""Replica load: how busy each engine replica is now, the one load model every policy prices.

Owns ``ReplicaLoad`` (one replica's load), ``LoadTracker`` (the requests a router sent, fed
by explicit events), its typed ``LoadSnapshot`` of ``TrackedRequest``s (what routers share
through the in-flight board) and ``replica_load``, the one rule that merges a replica's
reported stats with the requests the routers track. No I/O, no Ray.

Events, in the order a request usually meets them: ``decided`` (a router chose the replica,
with the prompt tokens the request will prefill there: the prompt less the blocks the index
matched), ``routed`` (Serve sent it, to another replica when the chosen one was full),
``first_output`` (its first output reached the caller: it is past its prefill) and
``completed`` (it finished, failed or was rejected). A decision counts from the moment it is
made, not from Serve's confirmation a round trip later, so the decisions of a burst see each
other. Serve may deliver them in other orders; each method says what it does then.

The rule (``replica_load``). A replica's stats (``ReplicaStats``, about once a second)
describe every request on it at their ``as_of_s``; the tracked requests describe what the
routers sent, now. Each tracked request is the tracker's to describe: queued with its prefill
tokens until its first output, then running, gone once completed. The stats describe only
the requests nobody tracks (another caller's, or a peer router's the board did not tell):
those they report beyond the tracked requests they can show (decided by ``as_of_s`` and not
completed by then), priced at the stats' share (their waiting requests and queued tokens in
the proportion of untracked to reported requests). So a request that finished after the stats
counts nowhere, a decision after them counts once, and stats older than the routers' events
never overrule them. Stats without a time (``as_of_s`` 0) are taken to show every tracked
request still in flight.

How it fails: a caller that never reports first outputs leaves its requests queued until they
complete (a decoding request is priced as its prefill again); requests of a router whose board
reports are missing count only through the stats, up to a period late; a decision Serve never
confirms stops counting after ``UNCONFIRMED_TTL_S``. Thread-safe (one lock): Serve calls the
router from its event loop and callback threads, the ingress reports first outputs from its
own loop.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from router.protocol import ReplicaStats

UNCONFIRMED_TTL_S = 5.0
"""A decision Serve never confirms (the caller gave up before it was sent) stops counting
after this long."""
COMPLETED_KEY_MEMORY_S = 60.0
"""How long a completed request's key is remembered, so that a confirmation arriving after
its completion is ignored (the two arrive within one event-loop turn of each other)."""
COMPLETED_SHOWN_S = 10.0
"""A completed request stays in snapshots until stats of its replica taken after it are seen
(``LoadTracker.loads``), at most this long: stats older than that are not in use."""


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load as the policies price it."""

    num_queued: int = 0
    """Requests with no output yet: waiting for or in their prefill."""
    queued_prefill_tokens: int = 0
    """Prompt tokens those requests have still to prefill (cache hits excluded)."""
    num_running: int = 0
    """Requests past their first output: decoding."""

    @property
    def num_requests(self) -> int:
        return self.num_queued + self.num_running


class TrackedRequest(NamedTuple):
    """One request a router sent a replica, as snapshots carry it. Times are wall clock
    (``time.time``), compared with the stats' ``as_of_s``: across a cluster's hosts they agree
    to within the hosts' clock skew, which shifts which requests count as shown by the
    stats by that much."""

    decided_at_s: float
    prefill_tokens: int
    first_output_at_s: float | None = None
    completed_at_s: float | None = None

    @property
    def in_flight(self) -> bool:
        return self.completed_at_s is None

    @property
    def queued(self) -> bool:
        return self.completed_at_s is None and self.first_output_at_s is None

    def shown_by(self, as_of_s: float) -> bool:
        """Whether stats taken at ``as_of_s`` count this request (0: unknown time, taken to
        show it while it is in flight)."""
        if as_of_s <= 0:
            return self.in_flight
        completed_at_s = self.completed_at_s
        return self.decided_at_s <= as_of_s and (completed_at_s is None or completed_at_s > as_of_s)


@dataclass(frozen=True)
class LoadSnapshot:
    """Replica id -> the tracked requests on it, oldest decision first: one tracker's, or
    several merged. What a router publishes to the in-flight board and reads of its peers."""

    requests: Mapping[str, tuple[TrackedRequest, ...]] = field(default_factory=dict)

    def on(self, replica_id: str) -> tuple[TrackedRequest, ...]:
        return self.requests.get(replica_id, ())

    @property
    def num_in_flight(self) -> int:
        return sum(r.in_flight for rows in self.requests.values() for r in rows)

    def merged(self, *others: LoadSnapshot) -> LoadSnapshot:
        rows: dict[str, list[TrackedRequest]] = {}
        for snapshot in (self, *others):
            for replica_id, requests in snapshot.requests.items():
                rows.setdefault(replica_id, []).extend(requests)
        return LoadSnapshot(
            {rid: tuple(sorted(reqs, key=_decided_at)) for rid, reqs in rows.items()}
        )


class _Tally:
    """What ``replica_load`` needs of a replica's tracked requests, summed against its stats'
    ``as_of_s``: one request at a time (``add``) or a group already counted (``add_counts``);
    no request list is built or sorted."""

    __slots__ = ("as_of_s", "num_in_flight", "num_queued", "queued_prefill_tokens", "num_shown")

    def __init__(self, as_of_s: float) -> None:
        self.as_of_s = as_of_s
        self.num_in_flight = self.num_queued = self.queued_prefill_tokens = self.num_shown = 0

    def add(
        self,
        decided_at_s: float,
        prefill_tokens: int,
        first_output_at_s: float | None,
        completed_at_s: float | None,
    ) -> None:
        """One request, as ``TrackedRequest``'s fields (``shown_by`` inlined)."""
        as_of_s = self.as_of_s
        if completed_at_s is None:
            self.num_in_flight += 1
            if first_output_at_s is None:
                self.num_queued += 1
                self.queued_prefill_tokens += prefill_tokens
            if as_of_s <= 0 or decided_at_s <= as_of_s:
                self.num_shown += 1
        elif as_of_s > 0 and decided_at_s <= as_of_s < completed_at_s:
            self.num_shown += 1

    def add_counts(self, counts: _Counts) -> None:
        self.num_in_flight += counts.num_in_flight
        self.num_queued += counts.num_queued
        self.queued_prefill_tokens += counts.queued_prefill_tokens
        self.num_shown += counts.num_shown

    def counts(self) -> _Counts:
        return _Counts(
            self.num_in_flight, self.num_queued, self.queued_prefill_tokens, self.num_shown
        )

    def load(self, stats: ReplicaStats) -> ReplicaLoad:
        """The rule (module docstring): the tracked requests, and the stats' share of the
        requests nobody tracks."""
        num_reported = stats.num_waiting + stats.num_running
        num_untracked = max(0, num_reported - self.num_shown)
        share = num_untracked / num_reported if num_reported else 0.0
        untracked_queued = round(stats.num_waiting * share)
        return ReplicaLoad(
            num_queued=self.num_queued + untracked_queued,
            queued_prefill_tokens=(
                self.queued_prefill_tokens + round(stats.num_queued_prefill_tokens * share)
            ),
            num_running=(self.num_in_flight - self.num_queued + num_untracked - untracked_queued),
        )


class _Counts(NamedTuple):
    """A group of tracked requests on one replica as ``_Tally`` counts them."""

    num_in_flight: int
    num_queued: int
    queued_prefill_tokens: int
    num_shown: int


def replica_load(stats: ReplicaStats, requests: Sequence[TrackedRequest] = ()) -> ReplicaLoad:
    """The replica's load now from its last stats and the routers' tracked requests on it
    (module docstring, "The rule"); with no tracked requests, the stats' load."""
    tally = _Tally(stats.as_of_s)
    for request in requests:
        tally.add(*request)
    return tally.load(stats)


@dataclass
class _Entry:
    replica_id: str
    prefill_tokens: int
    order: int
    """When it was decided (a counter): snapshots list a replica's requests oldest first."""
    decided_at_s: float
    expiry_s: float | None
    """When an unconfirmed decision stops counting; None once Serve confirmed it."""
    first_output_at_s: float | None = None

    def tracked(self, completed_at_s: float | None = None) -> TrackedRequest:
        return TrackedRequest(
            self.decided_at_s, self.prefill_tokens, self.first_output_at_s, completed_at_s
        )


class _OnReplica:
    """One tracker's requests in flight on one replica, with the sums ``LoadTracker.loads``
    needs kept as they change: a decision reads them instead of walking every request.

    ``add_to`` counts the requests decided by its tally's ``as_of_s`` as shown by the stats;
    it recounts this replica's requests only when ``as_of_s`` changes (a new stats report),
    and keeps the count as requests come and go in between."""

    __slots__ = ("entries", "num_queued", "queued_prefill_tokens", "_as_of_s", "_num_unshown",
                 "_rows")  # fmt: skip

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.num_queued = 0
        self.queued_prefill_tokens = 0
        self._as_of_s = 0.0
        """The stats time ``_num_unshown`` counts against (0: none yet)."""
        self._num_unshown = 0
        """Requests decided after ``_as_of_s``."""
        self._rows: tuple[tuple[int, TrackedRequest], ...] | None = None
        """The requests as ``snapshot`` lists them; None after a change."""

    def add(self, key: str, entry: _Entry) -> None:
        self.entries[key] = entry
        self._count(entry, 1)

    def remove(self, key: str) -> _Entry:
        entry = self.entries.pop(key)
        self._count(entry, -1)
        return entry

    def started(self, entry: _Entry, at_s: float) -> None:
        """``entry``'s first output, at ``at_s``: queued no longer."""
        self._count(entry, -1)
        entry.first_output_at_s = at_s
        self._count(entry, 1)

    def _count(self, entry: _Entry, sign: int) -> None:
        if entry.first_output_at_s is None:
            self.num_queued += sign
            self.queued_prefill_tokens += sign * entry.prefill_tokens
        if self._as_of_s > 0 and entry.decided_at_s > self._as_of_s:
            self._num_unshown += sign
        self._rows = None

    def add_to(self, tally: _Tally) -> None:
        """Adds the requests in flight here to ``tally``, as it counts them against its
        ``as_of_s``."""
        num_in_flight = len(self.entries)
        tally.num_in_flight += num_in_flight
        tally.num_queued += self.num_queued
        tally.queued_prefill_tokens += self.queued_prefill_tokens
        as_of_s = tally.as_of_s
        if as_of_s <= 0:
            tally.num_shown += num_in_flight
            return
        if as_of_s != self._as_of_s:
            self._as_of_s = as_of_s
            self._num_unshown = sum(e.decided_at_s > as_of_s for e in self.entries.values())
        tally.num_shown += num_in_flight - self._num_unshown

    def rows(self) -> tuple[tuple[int, TrackedRequest], ...]:
        """(decision order, request) for each request in flight, built once per change."""
        if self._rows is None:
            self._rows = tuple((e.order, e.tracked()) for e in self.entries.values())
        return self._rows


class LoadTracker:
    """The requests a router sent each replica, from decision to completion, keyed by the
    caller's request key; and the replicas' loads from them (``loads``).

    Serve registers the completion callback before it awaits the replica's acceptance, so a
    short request can be completed before it is confirmed: a confirmation on the replica a
    key completed on, within ``COMPLETED_KEY_MEMORY_S``, is ignored (it would re-create an
    entry nothing removes). A completion removes an entry only on the replica it names: the
    completion of an attempt the replica rejected can arrive after the retry was decided
    elsewhere. What it cannot tell apart: a retry decided for the very replica that rejected
    the first attempt, whose rejection completes after the retry's decision, is not counted.

    Cost: every event updates its replica's sums (``_OnReplica``), so ``loads`` costs a
    decision one step per replica, plus the completions its stats may still show, plus the
    peers' requests on replicas whose peer rows or stats changed since the last call.
    Unconfirmed decisions expire in the order they were made (one TTL; a clock stepping back
    delays the expiry of the decisions made just before the step by as much).
    """

    def __init__(
        self,
        unconfirmed_ttl_s: float = UNCONFIRMED_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.unconfirmed_ttl_s = unconfirmed_ttl_s
        self.tracker_id = uuid.uuid4().hex
        """Names this tracker's snapshots where routers share them (the in-flight board)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._on: dict[str, _OnReplica] = {}
        """Replica id -> the entries in flight there, with their sums."""
        self._unconfirmed: OrderedDict[str, None] = OrderedDict()
        """Keys of the decisions Serve has not confirmed, oldest decision first."""
        self._order = itertools.count()
        self._done: dict[str, list[TrackedRequest]] = {}
        """Replica id -> completed requests stats may still show (``COMPLETED_SHOWN_S``)."""
        self._completed_keys: OrderedDict[str, tuple[float, str]] = OrderedDict()
        """Key -> (time it completed, the replica it completed on), oldest first."""
        self._peer_counts: dict[str, tuple[tuple[TrackedRequest, ...], float, _Counts]] = {}
        """Replica id -> (the peers' rows, the stats time, their counts) of the last ``loads``."""
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` is called after every event (outside the lock); it must be cheap."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in list(self._listeners):  # a router may come or go meanwhile
            listener()

    # ------------------------------------------------------------- entries (under the lock)
    def _add(self, key: str, entry: _Entry) -> None:
        self._entries[key] = entry
        on = self._on.get(entry.replica_id)
        if on is None:
            on = self._on[entry.replica_id] = _OnReplica()
        on.add(key, entry)
        if entry.expiry_s is not None:
            self._unconfirmed[key] = None

    def _remove(self, key: str) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        on = self._on[entry.replica_id]
        on.remove(key)
        if not on.entries:
            del self._on[entry.replica_id]
        self._unconfirmed.pop(key, None)
        return entry

    def _expire(self, now_s: float) -> None:
        """Drops the unconfirmed decisions whose time is up."""
        while self._unconfirmed:
            key = next(iter(self._unconfirmed))
            entry = self._entries[key]
            if entry.expiry_s is None or entry.expiry_s > now_s:
                break
            self._remove(key)

    # ------------------------------------------------------------------------- events
    def decided(self, key: str, replica_id: str, prefill_tokens: int) -> None:
        """A router chose ``replica_id`` for request ``key`` (again, on a retry: the newer
        decision replaces the older)."""
        now_s = self._clock()
        with self._lock:
            self._completed_keys.pop(key, None)  # a retry after a rejection: a new attempt
            self._remove(key)
            self._add(
                key,
                _Entry(
                    replica_id,
                    prefill_tokens,
                    next(self._order),
                    now_s,
                    now_s + self.unconfirmed_ttl_s,
                ),
            )
        self._changed()

    def routed(self, key: str, replica_id: str) -> None:
        """Serve sent request ``key`` to ``replica_id``: it counts there until completed. An
        entry already confirmed stays as it is; a key that already completed on
        ``replica_id`` is dropped; a key whose decision expired counts with 0 prefill tokens."""
        now_s = self._clock()
        with self._lock:
            done = self._completed_keys.get(key)
            if done is not None and done[1] == replica_id:
                del self._completed_keys[key]
                self._remove(key)  # its decision, if Serve fell through to here
            elif (entry := self._entries.get(key)) is None:
                self._add(key, _Entry(replica_id, 0, next(self._order), now_s, None))
            elif entry.expiry_s is not None:
                self._remove(key)
                entry.replica_id, entry.expiry_s = replica_id, None
                self._add(key, entry)
        self._changed()

    def first_output(self, key: str) -> bool:
        """Request ``key``'s first output reached its caller: it is running, no longer queued.
        False when the tracker does not hold the key (completed already, or another's)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            if entry.first_output_at_s is None:
                self._on[entry.replica_id].started(entry, self._clock())
        self._changed()
        return True

    def completed(self, key: str, replica_id: str) -> None:
        """Request ``key`` finished on ``replica_id`` (or was rejected or failed there)."""
        now_s = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.replica_id == replica_id:
                self._remove(key)
                self._done.setdefault(replica_id, []).append(entry.tracked(now_s))
            self._completed_keys[key] = (now_s, replica_id)
            self._completed_keys.move_to_end(key)
            while next(iter(self._completed_keys.values()))[0] < now_s - COMPLETED_KEY_MEMORY_S:
                self._completed_keys.popitem(last=False)
        self._changed()

    # -------------------------------------------------------------------------- views
    def snapshot(self) -> LoadSnapshot:
        """Every request this tracker holds per replica, oldest decision first: those in
        flight and those completed that stats may still show; expired decisions dropped."""
        now_s = self._clock()
        rows: dict[str, list[tuple[int, TrackedRequest]]] = {}
        with self._lock:
            self._expire(now_s)
            for replica_id, on in self._on.items():
                rows[replica_id] = list(on.rows())
            for replica_id, done in self._done.items():
                done[:] = [r for r in done if r.completed_at_s > now_s - COMPLETED_SHOWN_S]
                rows.setdefault(replica_id, []).extend((-1, r) for r in done)
        requests = {}
        for replica_id, ordered in rows.items():
            if ordered:
                requests[replica_id] = tuple(r for _, r in sorted(ordered, key=_decision_order))
        return LoadSnapshot(requests)

    def loads(
        self, stats: Mapping[str, ReplicaStats], peers: LoadSnapshot | None = None
    ) -> dict[str, ReplicaLoad]:
        """Replica id -> its load (``replica_load``) for every replica in ``stats``, from this
        tracker's requests and ``peers`` (other routers' snapshots). Forgets the completed
        requests that these stats no longer show, and decisions that expired. It runs on
        every routing decision: its cost is in the class docstring."""
        now_s = self._clock()
        peer_rows = peers.requests if peers is not None else {}
        loads = {}
        with self._lock:
            self._expire(now_s)
            for replica_id, done in self._done.items():
                replica_stats = stats.get(replica_id)
                as_of_s = replica_stats.as_of_s if replica_stats is not None else 0.0
                cutoff_s = max(as_of_s, now_s - COMPLETED_SHOWN_S)
                if done and done[0].completed_at_s <= cutoff_s:
                    done[:] = [r for r in done if r.completed_at_s > cutoff_s]
            for replica_id, replica_stats in stats.items():
                as_of_s = replica_stats.as_of_s
                tally = _Tally(as_of_s)
                if (on := self._on.get(replica_id)) is not None:
                    on.add_to(tally)
                for request in self._done.get(replica_id, ()):
                    tally.add(*request)
                if requests := peer_rows.get(replica_id):
                    tally.add_counts(self._counts_of_peers(replica_id, requests, as_of_s))
                loads[replica_id] = tally.load(replica_stats)
            if len(self._peer_counts) > len(stats):  # replicas gone: their rows go too
                self._peer_counts = {
                    rid: counts for rid, counts in self._peer_counts.items() if rid in stats
                }
        return loads

    def _counts_of_peers(
        self, replica_id: str, requests: tuple[TrackedRequest, ...], as_of_s: float
    ) -> _Counts:
        """The peers' ``requests`` on ``replica_id`` counted against ``as_of_s``; recounted
        only when either changed since the last decision (a peer snapshot's rows are kept
        until the next sync replaces them)."""
        cached = self._peer_counts.get(replica_id)
        if cached is not None and cached[0] is requests and cached[1] == as_of_s:
            return cached[2]
        tally = _Tally(as_of_s)
        for request in requests:
            tally.add(*request)
        counts = tally.counts()
        self._peer_counts[replica_id] = (requests, as_of_s, counts)
        return counts


def _decided_at(request: TrackedRequest) -> float:
    return request.decided_at_s


def _decision_order(row: tuple[int, TrackedRequest]) -> tuple[float, int]:
    order, request = row
    return request.decided_at_s, order
