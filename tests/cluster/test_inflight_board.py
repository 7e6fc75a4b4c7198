"""cluster.inflight_board: what every request router has in flight, shared between them.

The board itself (sequence numbers, expiry, merging) with a fake clock, and two
``PrefixAwareRequestRouter``s sharing one board in this process, driven like Serve drives
them: replica stats that are a second stale show every replica idle, so each router knows
only what the board tells it about the other's decisions.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.inflight_board import InflightBoard
from cluster.request_router import PrefixAwareRequestRouter
from router.embedded_index import EmbeddedIndex
from router.load import LoadSnapshot, TrackedRequest
from router.protocol import EventKind, KVEvent, KVEventBatch, ReplicaStats, Tier, hash_blocks
from tests.cluster.helpers import pending, request_router, running

BLOCK_SIZE = 16
MODEL_ID = "board-model"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def snapshot(**requests) -> LoadSnapshot:
    """Replica id -> (decided_at_s, prefill_tokens) of requests still queued."""
    return LoadSnapshot(
        {rid: tuple(TrackedRequest(*row) for row in rows) for rid, rows in requests.items()}
    )


def test_each_router_sees_the_others_snapshots_merged_oldest_first_but_not_its_own():
    board = InflightBoard(FakeClock())
    board.report("r1", 1, snapshot(a=[(1.0, 500), (3.0, 20)]), ttl_s=10.0)
    board.report("r2", 1, snapshot(a=[(2.0, 300)], b=[(4.0, 0)]), ttl_s=10.0)
    board.report("r3", 1, snapshot(b=[(0.5, 64)]), ttl_s=10.0)
    assert board.peers("r3") == snapshot(a=[(1.0, 500), (2.0, 300), (3.0, 20)], b=[(4.0, 0)])
    assert board.peers("r1") == snapshot(a=[(2.0, 300)], b=[(0.5, 64), (4.0, 0)])


def test_a_late_older_report_does_not_undo_a_newer_one():
    board = InflightBoard(FakeClock())
    assert board.report("r1", 2, LoadSnapshot(), ttl_s=10.0)  # the request completed...
    assert not board.report("r1", 1, snapshot(a=[(1.0, 500)]), ttl_s=10.0)  # ...decided late
    assert board.peers("r2") == LoadSnapshot()


def test_a_router_that_stops_reporting_stops_counting_after_the_ttl():
    clock = FakeClock()
    board = InflightBoard(clock)
    board.report("gone", 1, snapshot(a=[(1.0, 500)]), ttl_s=10.0)
    board.report("alive", 1, snapshot(a=[(2.0, 40)]), ttl_s=10.0)
    clock.now_s += 6.0
    board.report("alive", 2, snapshot(a=[(2.0, 40)]), ttl_s=10.0)  # a refresh
    clock.now_s += 6.0
    assert board.peers("me") == snapshot(a=[(2.0, 40)])
    assert board.last_report_s == 106.0


def board_router(policy: str, index: EmbeddedIndex, board=None) -> PrefixAwareRequestRouter:
    return request_router(
        {"block_size": BLOCK_SIZE, "policy": policy}, index, MODEL_ID, board=board
    )


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
        board = InflightBoard() if shared else None
        routers = [board_router(policy, index, board), board_router(policy, index, board)]
        chosen = route(routers, [0, 0, 1], candidates, first_token=1000 * (trial + 1))
        num_spread += len(set(chosen)) == 3
    if shared:
        assert num_spread == 12
    else:
        assert num_spread < 12


def test_the_board_view_counts_other_routers_even_with_empty_snapshots():
    board = InflightBoard(FakeClock())
    board.report("r1", 1, LoadSnapshot(), ttl_s=10.0)
    assert board.view("r2") == (LoadSnapshot(), 1)
    assert board.view("r1") == (LoadSnapshot(), 0)


def test_a_board_client_outside_a_ray_cluster_sends_nothing(monkeypatch):
    """A router left in a process whose Ray was shut down (a test's handle, a driver after
    ``ray.shutdown``) must not call the actor: Ray would start a local instance for it."""
    from cluster.inflight_board import ActorBoardClient

    looked_up = []
    mine = snapshot(x=[(1.0, 16)])
    client = ActorBoardClient(lambda: looked_up.append(1), lambda: mine)
    try:
        client._send(mine)
        assert looked_up == []
    finally:
        client.close()
    assert looked_up == []


class SilentBoard:
    """A board client whose reads never answer (the index actor down or too slow)."""

    def changed(self) -> None:
        pass

    def peers(self) -> None:
        return None

    def close(self) -> None:
        pass


def test_with_the_board_silent_the_other_routers_requests_count_through_the_stats():
    """Replica x's stats show three requests this router did not send (another router's; the
    board does not answer), y's show none; this router's own request on y, sent after those
    stats, is running. Least loaded sends the next request to y (one request, not x's
    three), and once y's stats show that request it still counts once."""
    router = request_router(
        {"block_size": BLOCK_SIZE, "policy": "least_loaded"},
        EmbeddedIndex(),
        MODEL_ID,
        board_client=SilentBoard(),
    )
    as_of_s = time.time() - 0.5
    router.load.decided("mine", "y", 64)
    router.load.routed("mine", "y")
    router.load.first_output("mine")
    candidates = [running("x", num_running=3, as_of_s=as_of_s), running("y", as_of_s=as_of_s)]
    ids = [9] * 96

    async def main():
        call = pending("next", ids, hash_blocks(ids, BLOCK_SIZE, MODEL_ID, None))
        return (await router.choose_replicas(candidates, call))[0][0].replica_id.unique_id

    assert asyncio.run(main()) == "y"
    newer = ReplicaStats(num_running=1, as_of_s=time.time())
    assert router.load.loads({"y": newer})["y"].num_requests == 2  # "mine" and "next"


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
        router = board_router("prefix", index, InflightBoard())
        keys = {name: f"{name}-{reported}" for name in ("x1", "x2", "y1")}
        for name, replica_id, tokens in (("x1", "x", 40), ("x2", "x", 40), ("y1", "y", 900)):
            router.load.decided(keys[name], replica_id, tokens)
            router.load.routed(keys[name], replica_id)
        rates = {"prefill_tokens_per_s": 300.0, "decode_tokens_per_s": 100.0}
        as_of_s = time.time() + 0.001
        candidates = [
            running("x", num_running=2, as_of_s=as_of_s, **rates),
            running("y", num_running=1, num_queued_prefill_tokens=900, as_of_s=as_of_s, **rates),
        ]
        router.load.first_output(keys["x1"])
        router.load.first_output(keys["x2"])
        if reported:
            router.load.first_output(keys["y1"])

        async def main(router=router, candidates=candidates):
            ranks = await router.choose_replicas(candidates, pending("new", warm, hashes))
            return ranks[0][0].replica_id.unique_id

        chosen[reported] = asyncio.run(main())
    assert chosen == {False: "x", True: "y"}
