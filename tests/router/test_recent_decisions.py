"""router.recent_decisions: a router's decisions that a lookup could not see in the index."""

from __future__ import annotations

from router.index_types import Match
from router.recent_decisions import RecentDecisions, merge_matches


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


BLOCKS = [bytes([i]) * 16 for i in range(6)]


def test_a_lookup_sees_the_decisions_made_after_it_started_as_leading_runs():
    recent = RecentDecisions(ttl_s=5.0, clock=Clock())
    mark = recent.landed_mark()
    recent.record("a", BLOCKS[:4])
    recent.record("b", BLOCKS[:2])
    recent.record("c", BLOCKS[1:4])  # no first block: no leading run
    assert recent.match(BLOCKS, after=mark) == {"a": Match(4), "b": Match(2)}


def test_decisions_the_index_held_when_the_lookup_started_are_left_to_the_index():
    recent = RecentDecisions(ttl_s=5.0, clock=Clock())
    seq = recent.record("a", BLOCKS[:3])
    recent.landed(seq)  # its speculative write is in the index
    mark = recent.landed_mark()
    assert recent.match(BLOCKS, after=mark) == {}
    # A replica that died or restarted meanwhile is the index's to forget: nothing is left.
    assert recent.match(BLOCKS, after=0) == {}


def test_entries_stay_until_every_lookup_that_started_before_their_write_has_matched():
    recent = RecentDecisions(ttl_s=5.0, clock=Clock())
    early, late = recent.landed_mark(), recent.landed_mark()
    recent.landed(recent.record("a", BLOCKS[:3]))  # written at once (no background writer)
    assert recent.match(BLOCKS, after=early) == {"a": Match(3)}
    assert recent.match(BLOCKS, after=late) == {"a": Match(3)}, "still needed by late"
    assert recent.match(BLOCKS, after=0) == {}, "pruned once both matched"


def test_entries_and_forgotten_lookups_expire_with_the_ttl():
    clock = Clock()
    recent = RecentDecisions(ttl_s=5.0, clock=clock)
    recent.landed_mark()  # a lookup whose caller was cancelled: never matched
    recent.record("a", BLOCKS[:3])  # a write that never landed (dropped from a full queue)
    clock.now_s += 5.1
    assert recent.match(BLOCKS, after=0) == {}
    assert not recent._holders and not recent._open_marks


def test_the_table_is_bounded():
    recent = RecentDecisions(ttl_s=5.0, clock=Clock(), max_blocks=4)
    recent.record("a", BLOCKS[:3])
    recent.record("b", BLOCKS[3:6])
    assert len(recent._holders) <= 4
    assert recent.match(BLOCKS, after=0) == {}, "a's decision, the oldest, went first"
    assert recent.match(BLOCKS[3:], after=0) == {"b": Match(3)}


def test_a_block_sent_again_stays_when_the_older_decision_goes():
    clock = Clock()
    recent = RecentDecisions(ttl_s=5.0, clock=clock)
    mark = recent.landed_mark()
    recent.record("a", BLOCKS[:3])
    clock.now_s += 3.0
    recent.record("a", BLOCKS[:2])  # the same replica again, later: a newer entry
    recent.record("b", BLOCKS[:1])
    clock.now_s += 2.5  # the first decision expired, the others did not
    assert recent.match(BLOCKS, after=mark) == {"a": Match(2), "b": Match(1)}
    clock.now_s += 3.0
    assert recent.match(BLOCKS, after=0) == {}
    assert not recent._holders and not recent._decisions


def test_merge_keeps_the_longer_of_the_index_and_the_recent_run():
    index = {"a": Match(2, host_blocks=2), "b": Match(5)}
    recent = {"a": Match(3), "b": Match(4), "c": Match(1)}
    assert merge_matches(index, recent) == {"a": Match(2, 2), "b": Match(5), "c": Match(1)}
    assert merge_matches(index, {"a": Match(6)})["a"] == Match(6)
