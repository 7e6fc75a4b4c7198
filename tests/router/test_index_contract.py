"""One contract for every PrefixIndex backend: embedded and a real redis-server."""

from __future__ import annotations

import pickle

import pytest

from router.index_types import Match
from router.liveness import ApplyOutcome
from router.protocol import Tier
from tests.router.helpers import CLEARED, batch, chain, removed, stored


def test_match_counts_leading_consecutive_device_blocks(make_index):
    index = make_index()
    blocks = chain(10)
    index.heartbeat("a", 0)
    assert index.apply(batch("a", 0, stored(blocks[:4]), stored(blocks[6:9]))) == (
        ApplyOutcome.APPLIED
    )
    assert index.match(blocks) == {"a": Match(device_blocks=4, host_blocks=0)}
    assert index.match(blocks[6:]) == {"a": Match(3, 0)}
    assert index.match(chain(3, first_token=7)) == {}
    assert index.match([]) == {}


def test_host_tier_blocks_follow_device_blocks(make_index):
    index = make_index()
    blocks = chain(8)
    index.heartbeat("a", 0)
    index.apply(batch("a", 0, stored(blocks[:3]), stored(blocks[3:6], Tier.HOST)))
    assert index.match(blocks) == {"a": Match(device_blocks=3, host_blocks=3)}
    # Only on the host tier from the very first block.
    index.heartbeat("b", 0)
    index.apply(batch("b", 0, stored(blocks[:2], Tier.HOST)))
    assert index.match(blocks)["b"] == Match(device_blocks=0, host_blocks=2)


def test_removed_and_cleared_events(make_index):
    index = make_index()
    blocks = chain(6)
    index.heartbeat("a", 0)
    index.apply_many([batch("a", 0, stored(blocks)), batch("a", 1, removed(blocks[2:3]))])
    assert index.match(blocks) == {"a": Match(2, 0)}
    index.apply(batch("a", 2, CLEARED))
    assert index.match(blocks) == {}
    index.apply(batch("a", 3, stored(blocks[:1])))
    assert index.match(blocks) == {"a": Match(1, 0)}


def test_several_replicas_and_apply_many_outcomes_in_order(make_index):
    index = make_index()
    blocks = chain(5)
    for rid in ("a", "b", "c"):
        index.heartbeat(rid, 0)
    outcomes = index.apply_many(
        [
            batch("a", 0, stored(blocks[:5])),
            batch("b", 0, stored(blocks[:1])),
            batch("b", 1, stored(blocks[1:2])),
            batch("b", 1, stored(blocks[2:3])),  # duplicate seq
            batch("c", 7, stored(blocks[:1])),  # joins mid-stream: must re-announce
        ]
    )
    assert outcomes == [
        ApplyOutcome.APPLIED,
        ApplyOutcome.APPLIED,
        ApplyOutcome.APPLIED,
        ApplyOutcome.IGNORED,
        ApplyOutcome.STALE,
    ]
    assert index.match(blocks) == {"a": Match(5, 0), "b": Match(2, 0)}
    assert index.replicas() == ["a", "b", "c"]


def test_sequence_gap_drops_entries_until_reannounce(make_index):
    index = make_index()
    blocks = chain(4)
    index.heartbeat("a", 0)
    index.apply(batch("a", 0, stored(blocks)))
    # Batch 1 was lost: a removal may be missing, so nothing of "a" can be trusted.
    assert index.apply(batch("a", 2, stored(blocks[:1]))) == ApplyOutcome.STALE
    assert index.match(blocks) == {}
    assert index.apply(batch("a", 3, stored(blocks))) == ApplyOutcome.STALE
    assert index.match(blocks) == {}
    assert index.apply(batch("a", 4, CLEARED, stored(blocks[:3]))) == ApplyOutcome.APPLIED
    assert index.match(blocks) == {"a": Match(3, 0)}
    assert index.apply(batch("a", 5, stored(blocks[3:]))) == ApplyOutcome.APPLIED
    assert index.match(blocks) == {"a": Match(4, 0)}


def test_new_epoch_drops_old_entries_and_old_epoch_is_void(make_index):
    index = make_index()
    blocks = chain(4)
    index.heartbeat("a", 0)
    index.apply(batch("a", 0, stored(blocks)))
    # The engine restarted: its first batch of epoch 1 opens a fresh stream.
    assert index.apply(batch("a", 0, stored(blocks[:1]), epoch=1)) == ApplyOutcome.APPLIED
    assert index.match(blocks) == {"a": Match(1, 0)}
    # A late batch of the dead engine changes nothing.
    assert index.apply(batch("a", 1, stored(blocks), epoch=0)) == ApplyOutcome.IGNORED
    assert index.match(blocks) == {"a": Match(1, 0)}
    # A heartbeat announcing epoch 2 drops everything at once.
    assert index.heartbeat("a", 2) is True
    assert index.match(blocks) == {}
    assert index.heartbeat("a", 1) is False
    assert index.apply(batch("a", 0, stored(blocks[:2]), epoch=2)) == ApplyOutcome.APPLIED
    assert index.match(blocks) == {"a": Match(2, 0)}


def test_seq_back_to_zero_is_a_restart_without_a_new_epoch(make_index):
    index = make_index()
    blocks = chain(4)
    index.heartbeat("a", 0)
    index.apply_many([batch("a", 0, stored(blocks)), batch("a", 1, removed(blocks[3:]))])
    assert index.match(blocks) == {"a": Match(3, 0)}
    assert index.apply(batch("a", 0, stored(blocks[:1]))) == ApplyOutcome.APPLIED
    assert index.match(blocks) == {"a": Match(1, 0)}
    assert index.apply(batch("a", 1, stored(blocks[1:2]))) == ApplyOutcome.APPLIED
    assert index.match(blocks) == {"a": Match(2, 0)}


def test_dead_replica_stops_counting_at_once_and_is_swept(make_index, clock):
    index = make_index(heartbeat_timeout_s=5.0)
    blocks = chain(3)
    index.heartbeat("a", 0)
    index.heartbeat("b", 0)
    index.apply_many([batch("a", 0, stored(blocks)), batch("b", 0, stored(blocks))])
    clock.advance(4.0)
    index.heartbeat("b", 0)
    clock.advance(1.5)  # "a" missed its heartbeat
    assert index.match(blocks) == {"b": Match(3, 0)}
    assert index.replicas() == ["b"]
    assert index.sweep() == ["a"]
    # "a" comes back with the same epoch, mid-stream: it must re-announce.
    index.heartbeat("a", 0)
    assert index.apply(batch("a", 1, stored(blocks))) == ApplyOutcome.STALE
    assert index.match(blocks) == {"b": Match(3, 0)}


def test_remove_replica(make_index):
    index = make_index()
    blocks = chain(2)
    index.heartbeat("a", 0)
    index.apply(batch("a", 0, stored(blocks)))
    index.remove_replica("a")
    assert index.match(blocks) == {}
    assert index.replicas() == []


def test_speculative_entries_count_on_device_until_they_expire(make_index, clock):
    index = make_index()
    blocks = chain(6)
    index.heartbeat("a", 0)
    index.apply(batch("a", 0, stored(blocks[:2])))
    index.record_speculative("a", blocks[2:5], ttl_s=5.0)
    assert index.match(blocks) == {"a": Match(5, 0)}
    clock.advance(4.9)
    index.heartbeat("a", 0)
    assert index.match(blocks) == {"a": Match(5, 0)}
    # Gone at the latest one TTL later (Redis buckets entries by expiry, TTL-wide buckets).
    clock.advance(5.2)
    index.heartbeat("a", 0)
    assert index.match(blocks) == {"a": Match(2, 0)}
    with pytest.raises(ValueError, match="ttl_s"):
        index.record_speculative("a", blocks, ttl_s=0)


def test_speculative_entries_in_one_call_count_as_written_one_by_one(make_index, clock):
    """``record_speculative_many``: every entry counts, each for its own replica; an empty
    entry and an unknown replica are skipped without failing the others."""
    index = make_index()
    blocks, other = chain(6), chain(4, first_token=50)
    for rid in ("a", "b"):
        index.heartbeat(rid, 0)
    index.apply(batch("a", 0, stored(blocks[:1])))
    index.record_speculative_many(
        [("a", blocks[1:4]), ("b", other), ("b", []), ("nobody", blocks), ("b", blocks[:2])],
        ttl_s=5.0,
    )
    assert index.match(blocks) == {"a": Match(4, 0), "b": Match(2, 0)}
    assert index.match(other) == {"b": Match(4, 0)}
    index.record_speculative_many([], ttl_s=5.0)
    for step_s in (5.1, 5.1):
        clock.advance(step_s)
        for rid in ("a", "b"):
            index.heartbeat(rid, 0)
    for rid in ("a", "b"):
        index.heartbeat(rid, 0)
    assert index.match(blocks) == {"a": Match(1, 0)}
    with pytest.raises(ValueError, match="ttl_s"):
        index.record_speculative_many([("a", blocks)], ttl_s=0)


def test_index_survives_pickling(make_index):
    index = make_index()
    blocks = chain(3)
    index.heartbeat("a", 0)
    index.apply(batch("a", 0, stored(blocks)))
    copy = pickle.loads(pickle.dumps(index))
    assert copy.match(blocks) == {"a": Match(3, 0)}
    copy.apply(batch("a", 1, removed(blocks[1:])))
    assert copy.match(blocks) == {"a": Match(1, 0)}
