"""BlockPool bookkeeping on small hand-checked cases."""

from __future__ import annotations

import pytest

from router.protocol import EventKind, hash_blocks
from worker.block_pool import BlockPool, NoFreeBlocksError


def test_eviction_order_lru_and_tail_before_parent():
    pool = BlockPool(4, 2)
    chain = pool.allocate(3)
    hashes = hash_blocks(list(range(6)), 2, "m")
    for i, (b, h) in enumerate(zip(chain, hashes, strict=True)):
        pool.cache_block(b, h, list(range(i * 2, i * 2 + 2)))
    pool.free(chain)
    # The untouched block 3 goes first, then the chain from its tail.
    order = [pool.allocate(1)[0].block_id for _ in range(4)]
    assert order == [3, chain[2].block_id, chain[1].block_id, chain[0].block_id]


def test_freed_block_stays_matchable_until_reused_and_events():
    pool = BlockPool(2, 2)
    [b] = pool.allocate(1)
    h = hash_blocks([1, 2], 2, "m")
    pool.cache_block(b, h[0], [1, 2])
    pool.free([b])
    assert pool.find_cached_prefix(h, [1, 2]) == [b]
    pool.touch([b])
    assert pool.num_free_blocks == 1 and b.ref_count == 1
    pool.free([b])
    pool.allocate(2)  # reuses b: its hash is dropped
    assert pool.find_cached_prefix(h, [1, 2]) == []
    kinds = [e.kind for e in pool.take_events()]
    assert kinds == [EventKind.STORED, EventKind.REMOVED]


def test_token_mismatch_is_a_miss():
    pool = BlockPool(2, 2)
    [b] = pool.allocate(1)
    h = hash_blocks([1, 2], 2, "m")
    pool.cache_block(b, h[0], [1, 2])
    assert pool.find_cached_prefix(h, [1, 3]) == []
    assert pool.num_collisions == 1


def test_double_free_and_exhaustion_raise():
    pool = BlockPool(2, 2)
    blocks = pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])


def test_reset_only_when_idle():
    pool = BlockPool(2, 2)
    blocks = pool.allocate(1)
    assert not pool.reset_prefix_cache()
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.take_events()[-1].kind == EventKind.CLEARED


def test_empty_blocks_go_first_and_lru_age_says_how_long_unused_prefixes_stay():
    pool = BlockPool(4, 2)
    assert (pool.num_empty_free_blocks, pool.lru_age) == (4, 0)
    first, second = pool.allocate(1), pool.allocate(1)
    hashes = hash_blocks([1, 2, 3, 4], 2, "m")
    pool.cache_block(first[0], hashes[0], [1, 2])
    pool.cache_block(second[0], hashes[1], [3, 4])
    pool.free(first)  # release 1: a cached block, now the least recently used
    pool.free(second)  # release 2
    assert pool.num_empty_free_blocks == 2
    assert pool.lru_age == 1  # one release since the first block's
    [other] = pool.allocate(1)  # an empty block: no prefix evicted
    pool.free([other])  # release 3, freed after the cached ones, still handed out before them
    assert pool.lru_age == 2
    pool.touch(first)  # a hit brings the first block back into use
    assert pool.lru_age == 1  # the second block is now the least recently used
    pool.free(first)  # release 4
    pool.check_invariants()
    taken = pool.allocate(2)  # the two empty blocks: every prefix stays cached
    assert {b.block_id for b in taken}.isdisjoint({first[0].block_id, second[0].block_id})
    assert pool.num_empty_free_blocks == 0 and pool.lru_age == 2
    assert pool.find_cached_prefix(hashes, [1, 2, 3, 4]) == [first[0], second[0]]
    pool.allocate(1)  # now a prefix goes: the least recently used, the second block
    assert pool.find_cached_prefix(hashes[1:], [3, 4]) == []
    assert pool.lru_age == 0  # the first block is the last cached one: released just now
    pool.check_invariants()
