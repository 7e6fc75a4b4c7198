"""Helpers of the router tests: block hash chains and the KV events and batches that the
index contract (``test_index_contract.py``), the publisher and the router tests feed an index."""

from __future__ import annotations

from router.protocol import EventKind, KVEvent, KVEventBatch, Tier, hash_blocks

BLOCK_SIZE = 16


def chain(num_blocks: int, first_token: int = 0) -> list[bytes]:
    tokens = [first_token + i for i in range(num_blocks * BLOCK_SIZE)]
    return hash_blocks(tokens, BLOCK_SIZE, "test-model")


def stored(hashes, tier=Tier.DEVICE) -> KVEvent:
    return KVEvent(EventKind.STORED, tuple(hashes), tier)


def removed(hashes, tier=Tier.DEVICE) -> KVEvent:
    return KVEvent(EventKind.REMOVED, tuple(hashes), tier)


CLEARED = KVEvent(EventKind.CLEARED)


def batch(replica_id: str, seq: int, *events: KVEvent, epoch: int = 0) -> KVEventBatch:
    return KVEventBatch(replica_id, seq, tuple(events), replica_epoch=epoch)
