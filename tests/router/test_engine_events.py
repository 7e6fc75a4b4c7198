"""The engine's real KV events keep the index equal to the engine's prefix cache.

Drives ``worker.block_pool.BlockPool`` (the engine's cache, eviction and event source) with
random requests over a few shared prefixes, applies its per-step event batches to each
index backend, and checks after every step that ``match`` reports exactly the leading
blocks the pool can serve; then a lost batch, a re-announce (built here from the pool's
``cached_hashes``; a replica re-announces ``cluster/kv_publisher.py``'s mirror of the events it
forwarded, never the engine's cache), and a restarted pool (seq back to 0).
"""

from __future__ import annotations

import random

from router.liveness import ApplyOutcome
from router.protocol import EventKind, KVEvent, KVEventBatch, hash_blocks
from worker.block_pool import BlockPool

BLOCK_SIZE = 4
MODEL_ID = "events-model"
NUM_POOL_BLOCKS = 24  # small, so eviction happens every few requests


def _prompts(rng: random.Random) -> list[list[int]]:
    shared = [[rng.randrange(1000) for _ in range(5 * BLOCK_SIZE)] for _ in range(3)]
    return [
        rng.choice(shared)[: rng.randrange(1, 6) * BLOCK_SIZE]
        + [rng.randrange(1000) for _ in range(rng.randrange(0, 3) * BLOCK_SIZE)]
        for _ in range(60)
    ]


def _serve(pool: BlockPool, tokens: list[int]) -> list[bytes]:
    """One request's life in the pool: hit, allocate, compute (cache), finish (free)."""
    hashes = hash_blocks(tokens, BLOCK_SIZE, MODEL_ID)
    hits = pool.find_cached_prefix(hashes, tokens)
    pool.touch(hits)
    fresh = pool.allocate(len(hashes) - len(hits))
    for i, block in enumerate(fresh, start=len(hits)):
        pool.cache_block(block, hashes[i], tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
    pool.free(hits + fresh)
    return hashes


def _expected(pool: BlockPool, hashes: list[bytes]) -> int:
    cached = set(pool.cached_hashes())
    count = 0
    for h in hashes:
        if h not in cached:
            break
        count += 1
    return count


def _held(index, hashes: list[bytes]) -> int:
    match = index.match(hashes).get("r0")
    return 0 if match is None else match.device_blocks


def test_index_follows_the_block_pool_through_eviction_loss_and_restart(make_index):
    rng = random.Random(6)
    index = make_index()
    index.heartbeat("r0", 0)
    pool = BlockPool(NUM_POOL_BLOCKS, BLOCK_SIZE)
    prompts = _prompts(rng)
    seq = num_removed = 0
    for tokens in prompts:
        hashes = _serve(pool, tokens)
        events = tuple(pool.take_events())
        num_removed += sum(len(e.hashes) for e in events if e.kind == EventKind.REMOVED)
        if events:
            assert index.apply(KVEventBatch("r0", seq, events)) == ApplyOutcome.APPLIED
            seq += 1
        for probe in prompts[:10]:
            probe_hashes = hash_blocks(probe, BLOCK_SIZE, MODEL_ID)
            assert _held(index, probe_hashes) == _expected(pool, probe_hashes)
        assert _held(index, hashes) == _expected(pool, hashes)
    assert num_removed > 20  # the pool evicted plenty: removals were exercised

    # A batch is lost: the index refuses to guess until the pool re-announces.
    _serve(pool, prompts[0][:BLOCK_SIZE] + [7] * (4 * BLOCK_SIZE))
    pool.take_events()  # never delivered
    seq += 1
    _serve(pool, prompts[1])
    batch = KVEventBatch("r0", seq, tuple(pool.take_events()))
    assert index.apply(batch) == ApplyOutcome.STALE
    reannounce = (
        KVEvent(EventKind.CLEARED),
        KVEvent(EventKind.STORED, tuple(pool.cached_hashes())),
    )
    assert index.apply(KVEventBatch("r0", seq + 1, reannounce)) == ApplyOutcome.APPLIED
    for probe in prompts:
        probe_hashes = hash_blocks(probe, BLOCK_SIZE, MODEL_ID)
        assert _held(index, probe_hashes) == _expected(pool, probe_hashes)

    # The engine restarts under the same id and epoch: a fresh pool counts from seq 0.
    pool = BlockPool(NUM_POOL_BLOCKS, BLOCK_SIZE)
    hashes = _serve(pool, prompts[2])
    assert index.apply(KVEventBatch("r0", 0, tuple(pool.take_events()))) == ApplyOutcome.APPLIED
    for probe in prompts:
        probe_hashes = hash_blocks(probe, BLOCK_SIZE, MODEL_ID)
        assert _held(index, probe_hashes) == _expected(pool, probe_hashes)
    assert _held(index, hashes) == len(hashes)
