"""A decision priced with a KV pull names the peer and the blocks to pull, so the
replica can do what it was priced with; without pulls, or when the chosen replica holds the
most, a decision carries no pull."""

from __future__ import annotations

import dataclasses

import pytest

from router.config import RouterConfig
from router.index_types import Match
from router.load import replica_load
from router.policies import make_policy
from router.policy import ReplicaView, pull_source
from router.protocol import ReplicaStats, hash_blocks
from router.routing import Router

PULLS = RouterConfig(kv_pull_tokens_per_s=40_000.0)


def blocks(num_blocks: int) -> list[bytes]:
    return hash_blocks(list(range(7, 7 + 16 * num_blocks)), 16, "m")


def view(replica_id: str, **stats) -> ReplicaView:
    """A replica whose stats are its whole load (no tracked requests)."""
    replica_stats = ReplicaStats(**stats)
    return ReplicaView(replica_id, replica_stats, replica_load(replica_stats))


def test_pull_source_is_the_peer_with_the_most_device_blocks_beyond_the_replicas_own():
    matches = {"a": Match(10, 0), "b": Match(4, 9), "c": Match(10, 0), "d": Match(2, 0)}
    assert pull_source(matches, "d") == ("a", 10)  # ties: the smaller id, on every router
    assert pull_source(matches, "a") is None  # "c" holds no more than "a" itself
    assert pull_source(matches, "b") is None  # 13 blocks in its own two tiers: nothing to gain
    assert pull_source(matches, "x") == ("a", 10)
    assert pull_source({"a": Match(0, 10)}, "x") is None  # host-tier blocks are not exported


def test_a_decision_priced_with_a_pull_names_the_peer_and_the_blocks():
    hashes = blocks(128)
    holder = view("holder", num_waiting=1, num_queued_prefill_tokens=2400)
    replicas = [holder, view("cold")]
    matches = {"holder": Match(128, 0), "cold": Match(3, 0)}
    decision = make_policy(PULLS).choose(hashes, 2048 + 5, replicas, matches)
    assert decision.replica_id == "cold"
    assert (decision.pull_from, decision.pull_blocks) == ("holder", 128)
    off = make_policy(dataclasses.replace(PULLS, kv_pull_tokens_per_s=None))
    decision = off.choose(hashes, 2048 + 5, replicas, matches)
    assert decision.replica_id == "holder" and decision.pull_from is None
    assert decision.pull_blocks == 0
    # The holder itself wins when idle: no pull.
    decision = make_policy(PULLS).choose(hashes, 2053, [view("holder"), view("cold")], matches)
    assert decision.replica_id == "holder" and decision.pull_from is None


@pytest.mark.parametrize("index_down", [False, True])
def test_router_passes_the_pull_through_and_none_when_the_index_is_down(index_down):
    from router.embedded_index import EmbeddedIndex
    from router.protocol import EventKind, KVEvent, KVEventBatch

    hashes = blocks(8)
    index = EmbeddedIndex()
    index.apply(KVEventBatch("holder", 0, (KVEvent(EventKind.STORED, tuple(hashes)),)))
    index.heartbeat("cold", 0)  # live, holding nothing
    router = Router(PULLS, "m", index=index, speculate_in_background=False)
    if index_down:
        router.index.inner.match = _unavailable
    replicas = [view("holder", num_waiting=3, num_queued_prefill_tokens=5000), view("cold")]
    decision = router.route(hashes, 8 * 16 + 3, replicas)
    if index_down:
        assert decision.reason == "fallback" and decision.pull_from is None
    else:
        assert decision.replica_id == "cold"
        assert (decision.pull_from, decision.pull_blocks) == ("holder", 8)
        # Its speculative entry now says "cold" holds the prefix: the next one orders no pull.
        again = router.route(hashes, 8 * 16 + 3, replicas)
        assert again.replica_id == "cold" and again.pull_from is None


def _unavailable(*args, **kwargs):
    from router.index_types import IndexUnavailableError

    raise IndexUnavailableError("down")
