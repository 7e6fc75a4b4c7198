"""What one request router has sent each engine replica and not yet seen finish.

Owns the in-flight bookkeeping of ``cluster.request_router``. A decision counts on its replica
from the moment it is made: Serve confirms it (``on_request_routed``) only after the replica
accepted, a round trip later, and a burst decided meanwhile would otherwise all pile onto one
replica. Confirmation moves the entry to the replica Serve actually used (it falls through to
another when the chosen one is full); Serve's completion removes it; a decision never
confirmed (the caller gave up before it was sent) stops counting after ``ttl_s``.

Serve registers the completion callback before it awaits the replica's acceptance, so a short
request can be completed *before* it is confirmed. The ledger remembers which replica each
completed key finished on for ``COMPLETED_MEMORY_S`` and ignores a confirmation on that replica
that comes after; without that the late confirmation re-created an entry nothing would ever
remove, and a replica would look busier forever (prefix routing then sends repeats
elsewhere). A completion removes an entry only on the replica it names: the completion of an
attempt the replica rejected can arrive after the retry was decided elsewhere, and must not
take the retry's entry. What it cannot tell apart: a retry decided for the very replica that
rejected the first attempt, whose rejection completes after the retry's decision, is not counted.

Each entry carries the prompt tokens the request will prefill on its replica (the prompt less
the blocks the router matched there), so the policy prices the requests the replica's routing
stats do not show yet (they arrive once a second) with the prefill they queued, not as one
decode step each: without that, a burst of cold prompts all goes to the replica whose
measured prefill rate is highest until the load bound stops it.

Each entry also says whether the request is still waiting for its first output: the ingress's
``EngineClient`` reports that output (``first_output_arrived``, keyed by the internal request
id it gave the call) to every ledger in its process, and the one holding the key marks it.
A replica's in-flight requests that have not produced a token yet are its prefill queue *now*
(the stats are up to a period old); the policy prices that queue once a ledger has seen
marks (``marks_first_outputs``): callers that never report first outputs (a bare handle) keep
the stats-based estimate. Why it matters: under a closed loop of a few requests per
replica, a warm request's TTFT is set by whether its replica is prefilling another request
when it arrives.

Thread-safe (one lock; Serve calls the router from its event loop and routing threads).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

COMPLETED_MEMORY_S = 60.0
"""How long a completed request's key is remembered, so that a confirmation arriving after
its completion is ignored (the two arrive within one event-loop turn of each other)."""


@dataclass
class _Entry:
    replica_id: str
    prefill_tokens: int
    order: int
    """When it was decided (a counter): ``snapshot`` lists a replica's entries oldest first."""
    decided_at_s: float
    """Wall-clock time of the decision: orders this router's entries among its peers'
    (``cluster.inflight_board``)."""
    expiry_s: float | None
    """Monotonic time an unconfirmed decision stops counting; None once Serve confirmed it."""
    awaiting_first_output: bool = True
    """No output has reached the caller yet: the request is queued or prefilling."""


_LEDGERS: weakref.WeakSet[InflightLedger] = weakref.WeakSet()
_LEDGERS_LOCK = threading.Lock()


def first_output_arrived(key: str) -> None:
    """The first output of request ``key`` (Serve's internal request id) reached its caller:
    marks it in whichever ledger of this process holds it (the request router that decided
    it). Cheap and safe to call for a key no ledger holds."""
    with _LEDGERS_LOCK:
        ledgers = list(_LEDGERS)
    for ledger in ledgers:
        if ledger.first_output(key):
            return


class InflightLedger:
    """Requests in flight per replica, with the prompt tokens each will prefill there."""

    def __init__(self, ttl_s: float, on_change: Callable[[], None] | None = None) -> None:
        """``on_change`` is called after a first output is marked (``first_output_arrived``
        comes from outside the router, which publishes its ledger on every change)."""
        self.ttl_s = ttl_s
        self.on_change = on_change
        self.marks_first_outputs = False
        """A first output has been marked here: whoever calls through this router reports
        them, so an entry still awaiting one is queued or prefilling."""
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._order = itertools.count()
        self._completed: OrderedDict[str, tuple[float, str]] = OrderedDict()
        """Key -> (monotonic time it completed, the replica it completed on), oldest first
        (``COMPLETED_MEMORY_S``)."""
        with _LEDGERS_LOCK:
            _LEDGERS.add(self)

    def decided(self, key: str, replica_id: str, prefill_tokens: int) -> None:
        """The router chose ``replica_id`` for request ``key`` (again, on a retry: the newer
        decision replaces the older)."""
        expiry_s = time.monotonic() + self.ttl_s
        with self._lock:
            self._completed.pop(key, None)  # a retry after a rejection: a new attempt
            self._entries[key] = _Entry(
                replica_id, prefill_tokens, next(self._order), time.time(), expiry_s
            )

    def routed(self, key: str, replica_id: str) -> None:
        """Serve sent request ``key`` to ``replica_id``: it counts there until completed. An
        entry already confirmed stays as it is (Serve confirms a request once); a request that
        already completed on ``replica_id`` (its completion callback ran first) is dropped."""
        with self._lock:
            done = self._completed.get(key)
            if done is not None and done[1] == replica_id:
                del self._completed[key]
                self._entries.pop(key, None)  # its decision, if Serve fell through to here
                return
            entry = self._entries.get(key)
            if entry is None:  # its decision expired first: count it, prefill unknown
                self._entries[key] = _Entry(replica_id, 0, next(self._order), time.time(), None)
            elif entry.expiry_s is not None:
                entry.replica_id, entry.expiry_s = replica_id, None

    def first_output(self, key: str) -> bool:
        """Request ``key``'s first output reached its caller; False when this ledger does not
        hold it (another router's, or already completed)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.awaiting_first_output = False
            self.marks_first_outputs = True
        if self.on_change is not None:
            self.on_change()
        return True

    def completed(self, key: str, replica_id: str) -> None:
        """Serve's request ``key`` finished on ``replica_id`` (or was rejected there)."""
        now_s = time.monotonic()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.replica_id == replica_id:
                del self._entries[key]
            self._completed[key] = (now_s, replica_id)
            self._completed.move_to_end(key)
            while next(iter(self._completed.values()))[0] < now_s - COMPLETED_MEMORY_S:
                self._completed.popitem(last=False)

    def snapshot(self) -> dict[str, tuple[int, ...]]:
        """Replica id -> the prefill tokens of its in-flight requests, oldest decision first
        (the count is the tuple's length); expired unconfirmed decisions are dropped."""
        return {
            replica_id: tuple(tokens for _, tokens, _ in entries)
            for replica_id, entries in self.timed_snapshot().items()
        }

    def timed_snapshot(self) -> dict[str, tuple[tuple[float, int, bool], ...]]:
        """Replica id -> ``(decided_at_s, prefill_tokens, awaiting_first_output)`` of its
        in-flight requests, oldest decision first: what the router shares with its peers
        (``cluster.inflight_board``)."""
        now_s = time.monotonic()
        by_replica: dict[str, list[tuple[int, float, int, bool]]] = {}
        with self._lock:
            expired = [
                k
                for k, e in self._entries.items()
                if e.expiry_s is not None and e.expiry_s <= now_s
            ]
            for key in expired:
                del self._entries[key]
            for entry in self._entries.values():
                by_replica.setdefault(entry.replica_id, []).append(
                    (
                        entry.order,
                        entry.decided_at_s,
                        entry.prefill_tokens,
                        entry.awaiting_first_output,
                    )
                )
        return {
            replica_id: tuple(row[1:] for row in sorted(rows))
            for replica_id, rows in by_replica.items()
        }
