"""Simulated KV block caches: one replica's LRU (device tier, optional host tier), the oracle.

Block ids are opaque hashable values that are *prefix-chained*, exactly like the engine's block
hashes: the id of block ``i`` identifies the whole prefix ``0..i``. Two facts follow and the
code relies on them:

- A request touches its blocks tail first, head last (vLLM frees blocks in the same reverse
  order), so a parent block is always more recently used than any of its children and LRU
  evicts children first. A replica therefore holds a *prefix* of any chain, and the longest
  cached prefix can be found by binary search.
- The oracle (one infinite cache seeing every request) holds every block ever computed, so its
  hit on a request is the longest prefix already seen.

Failure modes: capacities are validated (``ValueError``); a request longer than the device
capacity simply evicts its own head blocks, as a real engine without pinning would.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

BlockId = Hashable
EvictCallback = Callable[[BlockId], None]


def longest_prefix(blocks: Sequence[BlockId], held: Callable[[BlockId], bool]) -> int:
    """Number of leading ``blocks`` for which ``held`` is true, assuming it holds for a prefix."""
    lo, hi = 0, len(blocks)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if held(blocks[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class LRUBlockCache:
    """A fixed number of block slots with least-recently-used eviction."""

    def __init__(
        self,
        capacity_blocks: int,
        on_store: EvictCallback | None = None,
        on_evict: EvictCallback | None = None,
    ) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[BlockId, None] = OrderedDict()
        self._on_store = on_store
        self._on_evict = on_evict

    def __contains__(self, block: BlockId) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def lru_order(self) -> list[BlockId]:
        """Blocks from least to most recently used."""
        return list(self._blocks)

    def match(self, blocks: Sequence[BlockId]) -> int:
        """Leading blocks of ``blocks`` held, without touching them."""
        return longest_prefix(blocks, self._blocks.__contains__)

    def put(self, block: BlockId) -> list[BlockId]:
        """Store or refresh one block as most recent; return the blocks evicted for it."""
        if block in self._blocks:
            self._blocks.move_to_end(block)
            return []
        if self.capacity_blocks == 0:
            return [block]
        evicted = []
        while len(self._blocks) >= self.capacity_blocks:
            old, _ = self._blocks.popitem(last=False)
            evicted.append(old)
            if self._on_evict is not None:
                self._on_evict(old)
        self._blocks[block] = None
        if self._on_store is not None:
            self._on_store(block)
        return evicted

    def evict_lru(self) -> BlockId:
        """Evict the least recently used block (the cache must not be empty)."""
        block, _ = self._blocks.popitem(last=False)
        if self._on_evict is not None:
            self._on_evict(block)
        return block

    def remove_quietly(self, block: BlockId) -> None:
        """Take ``block`` out without an eviction callback (it moves elsewhere, still stored)."""
        self._blocks.pop(block, None)

    def discard(self, block: BlockId) -> None:
        if block not in self._blocks:
            return
        del self._blocks[block]
        if self._on_evict is not None:
            self._on_evict(block)

    def touch_request(self, blocks: Sequence[BlockId]) -> list[BlockId]:
        """Store a request's blocks tail first (so its head is most recent); return evictions."""
        evicted: list[BlockId] = []
        for block in reversed(blocks):
            evicted.extend(self.put(block))
        return evicted


class BlockPool:
    """One replica's device KV blocks, kept the way vLLM's block pool keeps them.

    A block is *pinned* while running requests use it (never evicted), *cached* once free but
    still holding its hash (evictable, in the LRU), or one of ``num_reserved_blocks`` slots
    being computed (a prefill in flight, generated tokens). ``pinned + cached + reserved`` stays
    within ``capacity_blocks``: making room evicts the least recently freed cached block, which
    falls into the optional host tier. ``fits`` and ``can_reserve`` say whether a request's
    blocks would fit (what the simulator's admission and preemption ask, as the engine's
    scheduler does); a reservation past the capacity is still taken and counted in
    ``num_overflow_blocks`` (the simulator only makes one for a request larger than the pool).
    ``on_change(block, tier, stored)`` sees exactly the KV events an engine would publish.
    """

    def __init__(
        self,
        capacity_blocks: int,
        host_capacity_blocks: int = 0,
        on_change: Callable[[BlockId, str, bool], None] | None = None,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self._on_change = on_change
        self._device_removed = self._hook("device", False)
        self._device_stored = self._hook("device", True)
        self.capacity_blocks = capacity_blocks
        self.cached = LRUBlockCache(capacity_blocks, None, self._evicted)
        self.host = LRUBlockCache(
            host_capacity_blocks, self._hook("host", True), self._hook("host", False)
        )
        self.pinned: dict[BlockId, int] = {}
        self.num_reserved_blocks = 0
        self.num_overflow_blocks = 0
        self.num_releases = 0
        """``release`` calls so far: the pool's clock of use (the engine pool's)."""
        self._released_at: dict[BlockId, int] = {}
        """Cached block -> ``num_releases`` when it was last released."""

    def _hook(self, tier: str, stored: bool) -> EvictCallback | None:
        if self._on_change is None:
            return None
        on_change = self._on_change
        return lambda block: on_change(block, tier, stored)

    def _evicted(self, block: BlockId) -> None:
        if self._device_removed is not None:
            self._device_removed(block)
        if self.host.capacity_blocks > 0:
            self.host.put(block)

    def __contains__(self, block: BlockId) -> bool:
        return block in self.pinned or block in self.cached

    @property
    def num_used_blocks(self) -> int:
        return len(self.pinned) + len(self.cached) + self.num_reserved_blocks

    @property
    def num_empty_blocks(self) -> int:
        """Slots holding nothing: a prefix of up to this many blocks evicts none."""
        return max(0, self.capacity_blocks - self.num_used_blocks)

    @property
    def lru_age(self) -> int:
        """Releases since the least recently used cached block was released (the engine's
        ``BlockPool.lru_age``); 0 when nothing is cached."""
        lru = self.cached._blocks
        if not lru:
            return 0
        return self.num_releases - self._released_at.get(next(iter(lru)), 0)

    @property
    def num_busy_blocks(self) -> int:
        """Blocks that running requests hold (what ``kv_usage`` reports)."""
        return len(self.pinned) + self.num_reserved_blocks

    def match(self, blocks: Sequence[BlockId]) -> tuple[int, int]:
        """(device blocks, host blocks) of the longest prefix held: device ones first."""
        num_device = longest_prefix(blocks, self.__contains__)
        if self.host.capacity_blocks == 0:
            return num_device, 0
        num_host = 0
        for block in blocks[num_device:]:
            if block in self.host or block in self:
                num_host += 1
            else:
                break
        return num_device, num_host

    def can_reserve(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more slots fit without touching pinned or reserved ones."""
        return self.num_busy_blocks + num_blocks <= self.capacity_blocks

    def fits(self, blocks: Sequence[BlockId], num_more_blocks: int = 0) -> bool:
        """Whether ``begin(blocks)`` and then ``num_more_blocks`` more slots would fit: its
        device hit pinned (a cached hit leaves the evictable set) and a slot for every other
        block, evicting only cached blocks."""
        num_device, _ = self.match(blocks)
        newly_pinned = sum(1 for block in blocks[:num_device] if block not in self.pinned)
        return self.can_reserve(newly_pinned + len(blocks) - num_device + num_more_blocks)

    def reserve(self, num_blocks: int) -> None:
        """Take ``num_blocks`` free slots, evicting cached blocks (LRU first) to make room."""
        lru = self.cached._blocks
        excess = len(self.pinned) + len(lru) + self.num_reserved_blocks + num_blocks
        excess -= self.capacity_blocks
        if excess > 0:
            num_evicted = min(excess, len(lru))
            removed, host = self._device_removed, self.host
            for _ in range(num_evicted):  # hot loop: inlined LRUBlockCache.evict_lru
                block, _ = lru.popitem(last=False)
                if removed is not None:
                    removed(block)
                if host.capacity_blocks:
                    host.put(block)
            self.num_overflow_blocks += excess - num_evicted
        self.num_reserved_blocks += num_blocks

    def unreserve(self, num_blocks: int) -> None:
        self.num_reserved_blocks -= num_blocks

    def _pin(self, block: BlockId) -> None:
        count = self.pinned.get(block)
        if count is None:
            self.cached.remove_quietly(block)  # still stored: no event
            self.pinned[block] = 1
        else:
            self.pinned[block] = count + 1

    def begin(self, blocks: Sequence[BlockId]) -> tuple[int, int]:
        """Admit a request: pin its device hit, reserve slots for the rest (host hits included)."""
        num_device, num_host = self.match(blocks)
        for block in blocks[:num_device]:
            self._pin(block)
        for block in blocks[num_device : num_device + num_host]:
            self.host.discard(block)  # copied back to the device; stored there at commit
        self.reserve(len(blocks) - num_device)
        return num_device, num_host

    def commit(self, blocks: Sequence[BlockId], num_hit_blocks: int) -> None:
        """A prefill finished: its computed blocks become stored (and pinned) on the device."""
        self.unreserve(len(blocks) - num_hit_blocks)
        for block in blocks[num_hit_blocks:]:
            if block in self:
                self._pin(block)  # computed concurrently by another request: share it
                continue
            self.pinned[block] = 1
            if self._device_stored is not None:
                self._device_stored(block)

    def release(self, blocks: Sequence[BlockId]) -> None:
        """A request finished: unpin its blocks tail first, so the head stays most recent."""
        self.num_releases += 1
        released_at = self._released_at
        if len(released_at) > 4 * self.capacity_blocks:  # forget evicted blocks' stamps
            cached = self.cached._blocks
            self._released_at = released_at = {b: t for b, t in released_at.items() if b in cached}
        for block in reversed(blocks):
            count = self.pinned[block] - 1
            if count:
                self.pinned[block] = count
            else:
                del self.pinned[block]
                self.cached.put(block)
                released_at[block] = self.num_releases


class OracleCache:
    """One infinite cache that sees every request in arrival order: the hit-rate ceiling."""

    def __init__(self) -> None:
        self._seen: set[BlockId] = set()

    def hit_blocks(self, blocks: Sequence[BlockId]) -> int:
        """Leading blocks seen before; then remember all of ``blocks``."""
        hit = longest_prefix(blocks, self._seen.__contains__)
        self._seen.update(blocks)
        return hit
