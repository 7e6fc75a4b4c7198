"""An ``IndexMirror`` answers what the ``JournaledIndex`` it copies answered when it last
caught up: random changes (events, heartbeats, epochs, gaps, speculative entries, removals,
sweeps, time passing), caught up at random moments, by replayed changes or by a full copy
when the journal no longer reaches back or the index was re-created."""

from __future__ import annotations

import random

from router.index_journal import IndexMirror, JournaledIndex
from router.protocol import Tier
from tests.router.helpers import CLEARED, batch, chain, removed, stored

REPLICAS = ("a", "b", "c")


def _same(mirror: IndexMirror, index: JournaledIndex, queries) -> None:
    assert mirror.replicas() == index.replicas()
    for blocks in queries:
        assert mirror.match(blocks) == index.match(blocks)


def _random_change(rng: random.Random, index: JournaledIndex, seqs: dict, blocks, clock) -> None:
    replica = rng.choice(REPLICAS)
    roll = rng.random()
    if roll < 0.45:
        seq = seqs.get(replica, 0) + (1 if rng.random() < 0.9 else 2)  # now and then a gap
        seqs[replica] = seq
        lo = rng.randrange(len(blocks))
        hi = rng.randrange(lo, len(blocks)) + 1
        event = rng.choice(
            [stored(blocks[lo:hi]), stored(blocks[lo:hi], Tier.HOST), removed(blocks[lo:hi])]
        )
        events = (CLEARED, event) if rng.random() < 0.1 else (event,)
        index.apply(batch(replica, seq, *events, epoch=seqs.get(replica + "/epoch", 0)))
    elif roll < 0.65:
        if rng.random() < 0.1:  # the replica's engine restarted
            seqs[replica + "/epoch"] = seqs.get(replica + "/epoch", 0) + 1
            seqs[replica] = -1
        index.heartbeat(replica, seqs.get(replica + "/epoch", 0))
    elif roll < 0.8:
        index.record_speculative(replica, blocks[: rng.randrange(1, len(blocks))], 2.0)
    elif roll < 0.85:
        index.remove_replica(replica)
    elif roll < 0.9:
        index.sweep()
    else:
        clock.advance(rng.choice([0.5, 1.5, 4.0]))


def test_a_mirror_answers_what_the_index_answered(clock, test_seed):
    rng = random.Random(test_seed)
    blocks = chain(12)
    queries = [blocks, blocks[:3], blocks[5:], chain(4, first_token=99)]
    index = JournaledIndex(heartbeat_timeout_s=5.0, clock=clock, max_changes=24)
    mirrors = [IndexMirror(5.0, clock) for _ in range(2)]
    seqs: dict = {}
    full_copies = replays = 0
    for step in range(600):
        _random_change(rng, index, seqs, blocks, clock)
        for mirror in mirrors:
            if rng.random() < 0.15:
                answer = index.changes_since(mirror.instance_id, mirror.cursor)
                full_copies += answer.state is not None
                replays += answer.changes is not None
                mirror.catch_up(answer)
                _same(mirror, index, queries)
        if step == 300:  # the index is re-created (the actor died): mirrors start over
            index = JournaledIndex(heartbeat_timeout_s=5.0, clock=clock, max_changes=24)
            seqs.clear()
    assert full_copies >= 4 and replays > 50  # both ways were taken, more than once


def test_an_answer_is_replayed_once_however_often_asked(clock):
    index = JournaledIndex(heartbeat_timeout_s=5.0, clock=clock)
    blocks = chain(4)
    index.heartbeat("a", 0)
    index.apply(batch("a", 0, stored(blocks)))
    mirror = IndexMirror(5.0, clock)
    mirror.catch_up(index.changes_since(None, None))  # a full copy
    assert mirror.match(blocks)["a"].device_blocks == 4
    index.apply(batch("a", 1, removed(blocks[2:])))
    mirror.catch_up(index.changes_since(mirror.instance_id, mirror.cursor))
    again = index.changes_since(mirror.instance_id, mirror.cursor)
    assert again.changes == ()  # nothing new: nothing replayed twice
    mirror.catch_up(again)
    assert mirror.match(blocks)["a"].device_blocks == 2
