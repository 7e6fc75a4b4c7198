"""``cluster.index_mirror``: a router's copy of the index actor, without Ray (the actor's
``sync`` and writes answered in this process, ``ray.get`` passing values through).

The copy answers what the actor's index holds after a sync, shows the router's own
speculative entries at once, carries the other routers' requests and their count to the
board publisher, and stops answering (index unavailable, no peers) once it has not synced
for ``STALE_AFTER_S``, logged once, until the actor answers again."""

from __future__ import annotations

import logging
import time

import pytest

from cluster import index_mirror
from cluster.index_actor import ActorIndexClient
from cluster.index_mirror import ActorMirror, MirroredIndex
from cluster.inflight_board import ActorBoardClient, InflightBoard
from router.config import RouterConfig
from router.index_journal import JournaledIndex
from router.index_types import IndexUnavailableError, Match
from router.load import LoadSnapshot, TrackedRequest
from tests.router.helpers import batch, chain, stored


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class _Actor:
    """The index actor's ``sync``, writes and board report, in this process; ``down`` makes
    every call raise as an actor that cannot be found does."""

    def __init__(self) -> None:
        self.index = JournaledIndex()
        self.board = InflightBoard()
        self.down = False
        self.num_syncs = 0

        def sync(instance_id, cursor, router_id, with_index):
            self._check()
            self.num_syncs += 1
            answer = self.index.changes_since(instance_id, cursor) if with_index else None
            return (answer, *self.board.view(router_id))

        self.sync = _Method(sync)
        self.record_speculative = _Method(self.index.record_speculative)
        self.record_speculative_many = _Method(self.index.record_speculative_many)
        self.report_inflight = _Method(self.board.report)

    def _check(self) -> None:
        if self.down:
            raise ValueError("Failed to look up actor 'prefixserve-index:app'")


@pytest.fixture
def actor(monkeypatch):
    monkeypatch.setattr(index_mirror.ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(index_mirror.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(index_mirror, "SYNC_PERIOD_S", 30.0)  # the test syncs by hand
    monkeypatch.setattr(index_mirror, "IDLE_SYNC_PERIOD_S", 30.0)
    return _Actor()


def _mirror(actor, **kw) -> ActorMirror:
    return ActorMirror(lambda: actor, RouterConfig(), "me", with_index=True, **kw)


def test_the_copy_answers_the_actors_index_and_the_routers_own_entries_at_once(actor):
    blocks = chain(6)
    actor.index.heartbeat("a", 0)
    actor.index.apply(batch("a", 0, stored(blocks[:4])))
    actor.board.report("other", 1, LoadSnapshot(), ttl_s=10.0)  # another router reads it
    mirror = _mirror(actor)
    writer = ActorIndexClient("app", RouterConfig())
    writer._actor = actor
    index = MirroredIndex(mirror, writer)
    try:
        assert mirror.sync_once()
        assert index.match(blocks) == {"a": Match(4, 0)}
        actor.index.apply(batch("a", 1, stored(blocks[4:5])))
        assert index.match(blocks) == {"a": Match(4, 0)}  # not synced yet: a period behind
        index.record_speculative("a", blocks[4:], ttl_s=30.0)
        assert index.match(blocks) == {"a": Match(6, 0)}  # the router's own entry, at once
        assert actor.index.match(blocks) == {"a": Match(6, 0)}  # and on the actor
        assert mirror.sync_once()
        assert index.match(blocks) == {"a": Match(6, 0)}
        assert index.replicas() == ["a"]
    finally:
        mirror.close()


def test_a_router_alone_keeps_its_speculative_entries_in_its_copy(actor):
    """No other router reads the actor's index: the entry goes into the copy only, without
    an actor call; once the copy counts another router, entries reach the actor too."""
    blocks = chain(4)
    actor.index.heartbeat("a", 0)
    mirror = _mirror(actor)
    writer = ActorIndexClient("app", RouterConfig())
    writer._actor = actor
    index = MirroredIndex(mirror, writer)
    try:
        assert mirror.sync_once() and mirror.alone()
        index.record_speculative("a", blocks, ttl_s=30.0)
        assert index.match(blocks) == {"a": Match(4, 0)}  # its own copy has it
        assert actor.index.match(blocks) == {}  # the actor was not called
        actor.board.report("other", 1, LoadSnapshot(), ttl_s=10.0)
        assert mirror.sync_once() and not mirror.alone()
        index.record_speculative("a", blocks, ttl_s=30.0)
        assert actor.index.match(blocks) == {"a": Match(4, 0)}
    finally:
        mirror.close()


def test_the_copy_carries_the_other_routers_requests_and_their_count(actor):
    theirs = LoadSnapshot({"x": (TrackedRequest(1.0, 64),)})
    counts = []
    mirror = _mirror(actor, on_peers=counts.append)
    try:
        assert mirror.sync_once() and mirror.peers() == LoadSnapshot()
        actor.board.report("other", 1, theirs, ttl_s=10.0)
        actor.board.report("me", 1, LoadSnapshot({"y": (TrackedRequest(2.0, 8),)}), 10.0)
        assert mirror.sync_once() and mirror.peers() == theirs  # not its own
        assert counts[-2:] == [0, 1]
    finally:
        mirror.close()


def test_a_stale_copy_stops_answering_logged_once_until_the_actor_answers(actor, monkeypatch):
    monkeypatch.setattr(index_mirror, "STALE_AFTER_S", 0.2)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    serve_log = logging.getLogger("ray.serve")  # Serve's logger does not propagate to root
    serve_log.addHandler(handler)
    mirror = _mirror(actor)
    try:
        assert mirror.sync_once()
        actor.down = True
        assert not mirror.sync_once() and not mirror.sync_once()
        assert mirror.match(chain(2)) == {}  # still fresh: the last good copy answers
        time.sleep(0.3)
        with pytest.raises(IndexUnavailableError, match="old"):
            mirror.match(chain(2))
        assert mirror.peers() is None  # not {}: the router must know it lacks the peers
        actor.down = False
        assert mirror.sync_once()
        assert mirror.match(chain(2)) == {} and mirror.peers() == LoadSnapshot()
    finally:
        mirror.close()
        serve_log.removeHandler(handler)
    failures = [m for m in records if "sync failed" in m]
    assert len(failures) == 1, records
    assert any("answers again" in m for m in records)


def test_a_router_alone_publishes_no_change_until_the_copy_counts_another(actor, monkeypatch):
    from cluster import inflight_board

    monkeypatch.setattr(inflight_board.ray, "is_initialized", lambda: True)
    mine = LoadSnapshot({"x": (TrackedRequest(1.0, 16),)})
    publisher = ActorBoardClient(lambda: actor, lambda: mine, router_id="me")
    try:
        publisher.note_peers(0)
        publisher.changed()
        time.sleep(0.1)
        assert actor.board.view("observer") == (LoadSnapshot(), 0)  # nobody reads: not sent
        publisher.note_peers(1)  # another router appeared: what is in flight goes at once
        deadline = time.monotonic() + 2.0
        while actor.board.peers("observer") != mine:
            assert time.monotonic() < deadline, "never published once another router was seen"
            time.sleep(0.01)
    finally:
        publisher.close()
