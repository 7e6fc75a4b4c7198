"""KVEventPublisher: batches reach the index off the step path, heartbeats keep the replica
alive, a lost batch asks the engine to re-announce once."""

from __future__ import annotations

import time

import pytest

from router.index_types import Match
from router.liveness import ApplyOutcome
from router.publisher import KVEventPublisher
from tests.router.conftest import FakeClock
from tests.router.helpers import CLEARED, batch, chain, stored


def test_publish_applies_in_run_once_and_heartbeats(make_index, clock):
    index = make_index(heartbeat_timeout_s=5.0)
    monotonic = FakeClock()
    publisher = KVEventPublisher(index, "a", epoch=0, heartbeat_interval_s=2.0, clock=monotonic)
    blocks = chain(4)
    publisher.publish([batch("a", 0, stored(blocks[:2])), batch("a", 1, stored(blocks[2:]))])
    assert index.match(blocks) == {}  # nothing applied on the caller's path
    assert publisher.run_once() == [ApplyOutcome.APPLIED, ApplyOutcome.APPLIED]
    assert index.match(blocks) == {"a": Match(4, 0)}
    for _ in range(5):  # 20 s of heartbeats every 2 s (+ wall clock alike)
        monotonic.advance(2.0)
        clock.advance(2.0)
        publisher.run_once()
    assert index.replicas() == ["a"]
    clock.advance(5.1)  # heartbeats stop: dead at once
    assert index.match(blocks) == {}


def test_a_lost_batch_asks_for_one_reannounce(make_index):
    index = make_index()
    requests = []
    monotonic = FakeClock()
    publisher = KVEventPublisher(
        index,
        "a",
        epoch=0,
        heartbeat_interval_s=1.0,
        on_stale=lambda: requests.append(True),
        max_pending_batches=2,
        clock=monotonic,
    )
    blocks = chain(6)
    publisher.publish([batch("a", 0, stored(blocks[:1]))])
    publisher.run_once()
    # Three batches into a buffer of two: the oldest is dropped, the index sees a gap.
    publisher.publish([batch("a", i, stored(blocks[i : i + 1])) for i in (1, 2, 3)])
    assert publisher.num_dropped_batches == 1
    assert publisher.run_once() == [ApplyOutcome.STALE, ApplyOutcome.STALE]
    publisher.publish([batch("a", 4, stored(blocks[4:5]))])
    publisher.run_once()
    assert requests == [True]  # asked once, not once per stale batch
    monotonic.advance(6.0)
    publisher.publish([batch("a", 5, stored(blocks[5:6]))])
    publisher.run_once()
    assert requests == [True, True]  # still stale after the retry period: asked again
    publisher.publish([batch("a", 6, CLEARED, stored(blocks))])
    assert publisher.run_once() == [ApplyOutcome.APPLIED]
    assert index.match(blocks) == {"a": Match(6, 0)}


def test_thread_delivers_and_close_flushes(make_index):
    index = make_index()
    publisher = KVEventPublisher(index, "a", epoch=0, heartbeat_interval_s=0.05)
    publisher.start()
    blocks = chain(3)
    publisher.publish([batch("a", 0, stored(blocks))])
    deadline = time.monotonic() + 10.0
    while index.match(blocks) == {} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert index.match(blocks) == {"a": Match(3, 0)}
    publisher.publish([batch("a", 1, stored(chain(1, first_token=50)))])
    publisher.close()
    assert publisher.num_applied_batches == 2


def test_invalid_arguments_name_the_field(make_index):
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        KVEventPublisher(make_index(), "a", 0, heartbeat_interval_s=0)
    with pytest.raises(ValueError, match="max_pending_batches"):
        KVEventPublisher(make_index(), "a", 0, heartbeat_interval_s=1, max_pending_batches=0)
