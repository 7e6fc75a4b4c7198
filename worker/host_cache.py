"""``HostKVCache``: the second KV tier. Prefix blocks evicted from the device live on in RAM.

Tiers are exclusive: a cached block hash is held by the device pool or by this cache, never
both. When the device pool reuses a cached block, its KV is copied here (``save``) before
anything can overwrite it; a prefix hit on a host block copies it back into a fresh device
block (``load``) and drops it from here. Copies run at once, inside scheduling, so no later
step can read or overwrite a block whose copy is still pending.

This cache is LRU: when full, the least recently saved block is dropped (a ``removed`` event
with tier ``host``). Like the device pool, it compares the stored tokens on every hit.
The KV itself lives in one tensor ``[num_slots, num_layers, 2, block_size, kv_heads,
head_dim]`` (pinned memory on CUDA), owned by the model runner and moved by its ``KVMover``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.protocol import BlockHash, EventKind, KVEvent, Tier


class KVMover(Protocol):
    def save(self, block_id: int, slot: int) -> None:
        """Copy device block ``block_id`` into host slot ``slot``."""

    def load(self, slot: int, block_id: int) -> None:
        """Copy host slot ``slot`` into device block ``block_id``."""


@dataclass
class HostCounters:
    blocks_saved: int = 0
    blocks_loaded: int = 0
    blocks_dropped: int = 0


class HostKVCache:
    def __init__(self, num_slots: int, mover: KVMover, events: list[KVEvent]):
        if num_slots < 1:
            raise ValueError(f"host KV cache needs at least one block slot, got {num_slots}")
        self.num_slots = num_slots
        self._mover = mover
        self._events = events
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()
        """hash -> slot, least recently saved first."""
        self._tokens: dict[BlockHash, tuple[int, ...]] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.counters = HostCounters()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self) -> list[BlockHash]:
        return list(self._lru)

    def matches(self, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        return self._tokens.get(block_hash) == tuple(token_ids)

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The host slot holding ``block_hash`` (read-only: no LRU change), or None."""
        return self._lru.get(block_hash)

    def save(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Take an evicted device block's KV; drops the oldest host block when full."""
        if block_hash in self._lru:
            return
        if not self._free_slots:
            old_hash, old_slot = self._lru.popitem(last=False)
            del self._tokens[old_hash]
            self._free_slots.append(old_slot)
            self.counters.blocks_dropped += 1
            self._events.append(KVEvent(EventKind.REMOVED, (old_hash,), Tier.HOST))
        slot = self._free_slots.pop()
        self._mover.save(block_id, slot)
        self._lru[block_hash] = slot
        self._tokens[block_hash] = token_ids
        self.counters.blocks_saved += 1
        self._events.append(KVEvent(EventKind.STORED, (block_hash,), Tier.HOST))

    def load(self, block_hash: BlockHash, block_id: int) -> tuple[int, ...]:
        """Move a host block into device block ``block_id``; returns its tokens."""
        slot = self._lru.pop(block_hash)
        tokens = self._tokens.pop(block_hash)
        self._mover.load(slot, block_id)
        self._free_slots.append(slot)
        self.counters.blocks_loaded += 1
        self._events.append(KVEvent(EventKind.REMOVED, (block_hash,), Tier.HOST))
        return tokens

    def discard(self, block_hash: BlockHash) -> None:
        """Forget a block the device has recomputed (no copy needed)."""
        slot = self._lru.pop(block_hash, None)
        if slot is not None:
            del self._tokens[block_hash]
            self._free_slots.append(slot)
            self._events.append(KVEvent(EventKind.REMOVED, (block_hash,), Tier.HOST))

    def clear(self) -> None:
        self._free_slots.extend(self._lru.values())
        self._lru.clear()
        self._tokens.clear()

    def check_invariants(self) -> None:
        used = set(self._lru.values())
        if len(used) != len(self._lru) or used & set(self._free_slots):
            raise AssertionError("a host slot is used twice or both used and free")
        if len(used) + len(self._free_slots) != self.num_slots:
            raise AssertionError("host slots leaked")
