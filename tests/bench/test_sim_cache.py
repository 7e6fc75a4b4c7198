"""Bookkeeping of the simulated caches on small hand-checked cases: LRU order, the block pool's
pinning and eviction, the host tier, the oracle."""

import pytest

from bench.sim.cache import BlockPool, LRUBlockCache, OracleCache, longest_prefix


def test_lru_evicts_least_recently_used_and_refresh_moves_to_the_end():
    evicted = []
    cache = LRUBlockCache(3, on_evict=evicted.append)
    for block in ("a", "b", "c"):
        cache.put(block)
    cache.put("a")  # refresh: b is now the least recent
    assert cache.put("d") == ["b"]
    assert evicted == ["b"]
    assert cache.lru_order() == ["c", "a", "d"]


def test_request_blocks_are_touched_tail_first_so_the_head_is_evicted_last():
    cache = LRUBlockCache(4)
    cache.touch_request([1, 2, 3])
    assert cache.lru_order() == [3, 2, 1]
    assert cache.touch_request([1, 2, 4, 5]) == [3]  # room for 4 and 5 costs the old tail
    assert cache.match([1, 2, 4, 5]) == 4
    assert cache.match([1, 2, 3]) == 2


def test_longest_prefix_counts_leading_held_blocks():
    held = {1, 2, 3}
    assert longest_prefix([1, 2, 3, 4], held.__contains__) == 3
    assert longest_prefix([9, 1], held.__contains__) == 0
    assert longest_prefix([], held.__contains__) == 0


def test_pool_pins_running_blocks_and_evicts_only_free_cached_ones():
    events = []
    pool = BlockPool(4, on_change=lambda b, tier, stored: events.append((b, tier, stored)))
    assert pool.begin([1, 2]) == (0, 0)
    pool.commit([1, 2], 0)
    pool.release([1, 2])  # now cached and evictable, head most recent
    assert pool.begin([3, 4, 5]) == (0, 0)  # needs 3 slots: evicts 2 (the tail) only
    assert pool.match([1, 2]) == (1, 0)
    pool.commit([3, 4, 5], 0)
    assert pool.begin([1, 6]) == (1, 0)  # block 1 pinned again; one slot for 6 overflows
    assert pool.num_overflow_blocks == 1
    assert (2, "device", False) in events and (1, "device", False) not in events
    assert [e for e in events if e[2]] == [(1, "device", True), (2, "device", True)] + [
        (b, "device", True) for b in (3, 4, 5)
    ]


def test_pool_host_tier_catches_device_evictions_and_serves_them_back():
    pool = BlockPool(2, host_capacity_blocks=4)
    pool.begin([1, 2])
    pool.commit([1, 2], 0)
    pool.release([1, 2])
    pool.begin([7, 8])  # evicts 2 then 1 into the host tier
    assert pool.match([1, 2]) == (0, 2)
    pool.commit([7, 8], 0)
    pool.release([7, 8])
    assert pool.begin([1, 2, 3]) == (0, 2)
    assert 1 not in pool.host and 2 not in pool.host


def test_pool_rejects_a_nonpositive_capacity():
    with pytest.raises(ValueError, match="capacity_blocks"):
        BlockPool(0)


def test_oracle_hits_the_longest_prefix_seen_before():
    oracle = OracleCache()
    assert oracle.hit_blocks([1, 2, 3]) == 0
    assert oracle.hit_blocks([1, 2, 4]) == 2
    assert oracle.hit_blocks([1, 2, 4, 5]) == 3
    assert oracle.hit_blocks([6]) == 0
