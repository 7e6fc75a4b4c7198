"""cluster.inflight_board: what every request router has in flight, shared between them.

The board itself (sequence numbers, expiry, merging) with a fake clock, and two
``PrefixAwareRequestRouter``s sharing one board in this process, driven like Serve drives
them: replica stats that are a second stale show every replica idle, so each router knows
only what the board tells it about the other's decisions.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from cluster.inflight import first_output_arrived
from cluster.inflight_board import InflightBoard, LocalBoardClient, merge_inflight
from cluster.request_router import PrefixAwareRequestRouter
from router.embedded_index import EmbeddedIndex
from router.protocol import EventKind, KVEvent, KVEventBatch, Tier, hash_blocks
from router.routing import Router
from tests.cluster.helpers import pending, running

BLOCK_SIZE = 16
MODEL_ID = "board-model"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_each_router_sees_the_others_snapshots_merged_oldest_first_but_not_its_own():
    board = InflightBoard(FakeClock())
    board.report("r1", 1, {"a": ((1.0, 500), (3.0, 20))}, ttl_s=10.0)
    board.report("r2", 1, {"a": ((2.0, 300),), "b": ((4.0, 0),)}, ttl_s=10.0)
    board.report("r3", 1, {"b": ((0.5, 64),)}, ttl_s=10.0)
    assert board.peers("r3") == {"a": ((1.0, 500), (2.0, 300), (3.0, 20)), "b": ((4.0, 0),)}
    assert board.peers("r1") == {"a": ((2.0, 300),), "b": ((0.5, 64), (4.0, 0))}


def test_a_late_older_report_does_not_undo_a_newer_one():
    board = InflightBoard(FakeClock())
    assert board.report("r1", 2, {}, ttl_s=10.0)  # the request completed...
    assert not board.report("r1", 1, {"a": ((1.0, 500),)}, ttl_s=10.0)  # ...its decision late
    assert board.peers("r2") == {}


def test_a_router_that_stops_reporting_stops_counting_after_the_ttl():
    clock = FakeClock()
    board = InflightBoard(clock)
    board.report("gone", 1, {"a": ((1.0, 500),)}, ttl_s=10.0)
    board.report("alive", 1, {"a": ((2.0, 40),)}, ttl_s=10.0)
    clock.now_s += 6.0
    board.report("alive", 2, {"a": ((2.0, 40),)}, ttl_s=10.0)  # a refresh
    clock.now_s += 6.0
    assert board.peers("me") == {"a": ((2.0, 40),)}
    assert board.last_report_s == 106.0


def test_merge_orders_own_and_peer_requests_by_decision_time():
    own = {"a": ((2.0, 200),), "c": ((1.0, 16),)}
    peers = {"a": ((1.0, 500), (3.0, 0)), "b": ((5.0, 80),)}
    assert merge_inflight(own, peers) == {
        "a": ((1.0, 500), (2.0, 200), (3.0, 0)),
        "b": ((5.0, 80),),
        "c": ((1.0, 16),),
    }


def request_router(policy: str, index: EmbeddedIndex) -> PrefixAwareRequestRouter:
    router = object.__new__(PrefixAwareRequestRouter)  # Serve's own __init__ needs a cluster
    router.initialize_state({"block_size": BLOCK_SIZE, "policy": policy})
    router._router = Router(router.config, MODEL_ID, index=index, speculate_in_background=False)
    return router


def route(routers, turns, candidates, first_token: int) -> list[str]:
    """Requests with distinct cold prompts, decided by ``routers[turn]`` for each turn; none
    completes. The chosen replicas."""

    async def main():
        chosen = []
        for i, turn in enumerate(turns):
            ids = [first_token + i] + [7] * 95
            call = pending(f"q{first_token + i}", ids, hash_blocks(ids, BLOCK_SIZE, MODEL_ID, None))
            ranks = await routers[turn].choose_replicas(candidates, call)
            chosen.append(ranks[0][0].replica_id.unique_id)
        return chosen

    return asyncio.run(main())


@pytest.mark.parametrize("policy", ["least_loaded", "prefix"])
@pytest.mark.parametrize("shared", [True, False])
def test_a_router_sharing_a_board_sends_to_the_replica_the_other_left_idle(policy, shared):
    """Router A sends two requests, then router B one, to three replicas whose stats say idle:
    B's goes to the third replica when B sees A's two through the board; blind, B picks by
    its own tie-break and lands on one of A's in most of the 12 trials."""
    replica_ids = ["x", "y", "z"]
    num_spread = 0
    for trial in range(12):
        index = EmbeddedIndex()
        for replica_id in replica_ids:
            index.heartbeat(replica_id, 0)
        candidates = [running(r, prefill_tokens_per_s=200.0) for r in replica_ids]
        routers = [request_router(policy, index), request_router(policy, index)]
        if shared:
            board = InflightBoard()
            for router in routers:
                router._board = LocalBoardClient(board, router._inflight.timed_snapshot)
        chosen = route(routers, [0, 0, 1], candidates, first_token=1000 * (trial + 1))
        num_spread += len(set(chosen)) == 3
    if shared:
        assert num_spread == 12
    else:
        assert num_spread < 12


def test_an_unreachable_board_means_no_peers_logged_once_and_retried():
    """The actor cannot be found (``ray.get_actor``'s ``ValueError``): the router decides on
    its own ledger, warns once, and asks for the actor again on the next call."""
    from cluster.inflight_board import ActorBoardClient

    attempts = []

    def get_actor():
        attempts.append(1)
        raise ValueError("Failed to look up actor 'prefixserve-index:app'")

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    serve_log = logging.getLogger("ray.serve")  # Serve's logger does not propagate to root
    serve_log.addHandler(records)
    client = ActorBoardClient(get_actor, lambda: {"a": ((1.0, 16),)}, lookup_timeout_s=0.1)
    try:
        assert client.peers() is None  # not {}: the router must know it lacks the peers
        assert client.peers() is None
    finally:
        client.close()
        serve_log.removeHandler(records)
    warnings = [m for m in records.messages if "in-flight board" in m]
    assert len(warnings) == 1, warnings
    assert len(attempts) >= 2  # not cached as dead: each call resolves the actor again


def test_the_board_view_counts_other_routers_even_with_empty_snapshots():
    board = InflightBoard(FakeClock())
    board.report("r1", 1, {}, ttl_s=10.0)
    assert board.view("r2") == ({}, 1)
    assert board.view("r1") == ({}, 0)


class _BoardActor:
    """The index actor's board methods, answered in this process (``ray.get`` patched to
    pass values through), counting the round trips."""

    def __init__(self, board: InflightBoard) -> None:
        self.board = board
        self.num_views = 0
        outer = self

        class _Method:
            def __init__(self, fn):
                self.remote = fn

        def view(router_id):
            outer.num_views += 1
            return board.view(router_id)

        self.peer_view = _Method(view)
        self.report_inflight = _Method(board.report)


def test_a_router_alone_on_the_board_skips_round_trips_until_another_router_reports(
    monkeypatch,
):
    """One ingress replica: after one answer naming no other router, ``peers`` is ``{}``
    without a round trip and changes are not published; once another router reports, the
    next recheck sees it, and this router's in-flight requests reach the board at once."""
    from cluster import inflight_board
    from cluster.inflight_board import ActorBoardClient

    monkeypatch.setattr(inflight_board.ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(inflight_board.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(inflight_board, "ALONE_RECHECK_S", 0.05)
    board = InflightBoard()
    actor = _BoardActor(board)
    mine = {"x": ((1.0, 16, True),)}
    client = ActorBoardClient(lambda: actor, lambda: mine, lookup_timeout_s=1.0)
    try:
        assert client.peers() == {} and actor.num_views == 1
        assert client.peers() == {} and actor.num_views == 1  # alone: no round trip
        client.changed()
        time.sleep(0.1)
        assert board.view("observer") == ({}, 0)  # nobody reads it: nothing published
        board.report("other", 1, {"y": ((2.0, 8, True),)}, ttl_s=10.0)
        assert client.peers() == {"y": ((2.0, 8, True),)} and actor.num_views == 2
        deadline = time.monotonic() + 2.0
        while board.peers("other") != mine:
            assert time.monotonic() < deadline, "the router never published once seen"
            time.sleep(0.01)
        assert client.peers() == {"y": ((2.0, 8, True),)} and actor.num_views == 3
    finally:
        client.close()


def test_a_board_client_outside_a_ray_cluster_sends_nothing(monkeypatch):
    """A router left in a process whose Ray was shut down (a test's handle, a driver after
    ``ray.shutdown``) must not call the actor: Ray would start a local instance for it."""
    from cluster.inflight_board import ActorBoardClient

    looked_up = []
    client = ActorBoardClient(
        lambda: looked_up.append(1), lambda: {"x": ((1.0, 16, True),)}, lookup_timeout_s=0.1
    )
    try:
        client._send({"x": ((1.0, 16, True),)})
        assert looked_up == []
    finally:
        client.close()
    assert looked_up == []


def test_awaited_board_reads_skip_round_trips_while_alone_and_time_out_to_none(monkeypatch):
    """``peers_async`` (what the request router awaits on Serve's loop): the same answers as
    ``peers`` without a thread once the actor is known, ``{}`` with no call while alone, and
    None when the board does not answer in time."""
    from cluster import inflight_board
    from cluster.inflight_board import ActorBoardClient

    board = InflightBoard()
    calls = []
    stall = False

    class Actor:
        class peer_view:  # noqa: N801 - the actor method's name
            @staticmethod
            async def remote(router_id):
                calls.append(router_id)
                if stall:
                    await asyncio.sleep(10)
                return board.view(router_id)

        class report_inflight:  # noqa: N801
            @staticmethod
            def remote(*args):
                board.report(*args)

    monkeypatch.setattr(inflight_board.ray, "get", lambda ref, timeout=None: asyncio.run(ref))
    monkeypatch.setattr(inflight_board.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(inflight_board, "ALONE_RECHECK_S", 0.05)
    client = ActorBoardClient(lambda: Actor, dict, lookup_timeout_s=0.2)

    async def main():
        nonlocal stall
        assert await client.peers_async() == {} and len(calls) == 1  # resolves the actor
        assert await client.peers_async() == {} and len(calls) == 1  # alone: no call
        board.report("other", 1, {"y": ((2.0, 8, True),)}, ttl_s=10.0)
        await asyncio.sleep(0.06)
        assert await client.peers_async() == {"y": ((2.0, 8, True),)} and len(calls) == 2
        stall = True
        assert await client.peers_async() is None

    try:
        asyncio.run(main())
    finally:
        client.close()


def test_views_count_the_decisions_made_after_the_stats_as_unreported():
    """A replica's stats carry the time they were taken (``as_of_s``): the in-flight requests
    decided later are the ones they do not show, whatever the counts say; without a time the
    policy estimates (``num_unreported`` None)."""
    router = request_router("prefix", EmbeddedIndex())
    router._inflight.decided("old", "a", 300)
    time.sleep(0.01)
    as_of_s = time.time()
    time.sleep(0.01)
    router._inflight.decided("new", "a", 120)
    router._inflight.decided("other", "b", 40)
    stamped = running("a", num_running=2, as_of_s=as_of_s)
    unstamped = running("b", num_running=1)
    views = {v.replica_id: v for v in router._views([stamped, unstamped])}
    assert (views["a"].num_inflight, views["a"].num_unreported) == (2, 1)
    assert views["a"].inflight_prefill_tokens == (300, 120)
    assert views["b"].num_unreported is None


def test_views_are_complete_only_with_the_peers_answer():
    """With the board's answer (even an empty one: no other router has anything in flight)
    the in-flight counts are every router's, the load now; without it (None: the board did
    not answer) they are this router's alone and the stats stay in charge."""
    router = request_router("least_loaded", EmbeddedIndex())
    router._inflight.decided("mine", "a", 50)
    peers = {"b": ((time.time(), 80, True), (time.time(), 0, False))}
    replicas = [running("a", num_running=3), running("b", num_running=1)]
    views = {v.replica_id: v for v in router._views(replicas, peers)}
    assert [(views[r].num_inflight, views[r].inflight_complete) for r in "ab"] == [
        (1, True),
        (2, True),
    ]
    assert all(v.inflight_complete for v in router._views(replicas, {}))
    assert not any(v.inflight_complete for v in router._views(replicas, None))


def test_views_price_the_requests_awaiting_their_first_output_once_first_outputs_are_reported():
    """Every router's in-flight requests that have produced no output are the replica's
    prefill queue now. Until this router has seen a first output reported (a caller that
    never reports them) the view does not claim to know (None)."""
    router = request_router("prefix", EmbeddedIndex())
    router._inflight.decided("views-mine-done", "a", 50)
    router._inflight.decided("views-mine-prefilling", "a", 70)
    peers = {"a": ((time.time(), 300, True),), "b": ((time.time(), 80, False),)}
    replicas = [running("a", num_running=3), running("b", num_running=1)]
    views = {v.replica_id: v for v in router._views(replicas, peers)}
    assert views["a"].pending_prefill_tokens is None  # no first output reported yet
    first_output_arrived("views-mine-done")
    views = {v.replica_id: v for v in router._views(replicas, peers)}
    assert views["a"].pending_prefill_tokens == (70, 300)
    assert views["b"].pending_prefill_tokens == ()
    assert router._views(replicas, None)[0].pending_prefill_tokens is None  # board silent


def test_a_replica_whose_prefill_finished_since_its_stats_is_priced_as_free_to_start_another():
    """Both replicas hold the prompt's prefix. Their stats, taken after every decision, show
    x decoding two requests and y prefilling a long prompt (900 tokens queued); since then
    y's request produced its first output. Priced from the stats, y looks 3 s busy and the
    request goes to x; with the first outputs reported, y (one decode, no prefill) wins."""
    index = EmbeddedIndex()
    warm = [5] * 96
    hashes = hash_blocks(warm, BLOCK_SIZE, MODEL_ID, None)
    stored = KVEvent(EventKind.STORED, tuple(hashes), Tier.DEVICE)
    for replica_id in "xy":
        index.heartbeat(replica_id, 0)
        index.apply(KVEventBatch(replica_id, 0, (stored,)))
    chosen = {}
    for reported in (False, True):
        router = request_router("prefix", index)
        router._board = LocalBoardClient(InflightBoard(), router._inflight.timed_snapshot)
        keys = {name: f"{name}-{reported}" for name in ("x1", "x2", "y1")}  # unique per process
        for name, replica_id, tokens in (("x1", "x", 40), ("x2", "x", 40), ("y1", "y", 900)):
            router._inflight.decided(keys[name], replica_id, tokens)
            router._inflight.routed(keys[name], replica_id)
        rates = {"prefill_tokens_per_s": 300.0, "decode_tokens_per_s": 100.0}
        as_of_s = time.time() + 0.001
        candidates = [
            running("x", num_running=2, as_of_s=as_of_s, **rates),
            running("y", num_running=1, num_queued_prefill_tokens=900, as_of_s=as_of_s, **rates),
        ]
        first_output_arrived(keys["x1"])
        first_output_arrived(keys["x2"])
        if reported:
            first_output_arrived(keys["y1"])

        async def main(router=router, candidates=candidates):
            ranks = await router.choose_replicas(candidates, pending("new", warm, hashes))
            return ranks[0][0].replica_id.unique_id

        chosen[reported] = asyncio.run(main())
    assert chosen == {False: "x", True: "y"}
