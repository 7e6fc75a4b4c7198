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


class TieredCache:
    """A device LRU whose evictions fall into an optional host LRU (``host_capacity_blocks``)."""

    def __init__(
        self,
        device_capacity_blocks: int,
        host_capacity_blocks: int = 0,
        on_change: Callable[[BlockId, str, bool], None] | None = None,
    ) -> None:
        def hook(tier: str, stored: bool) -> EvictCallback | None:
            if on_change is None:
                return None
            return lambda block: on_change(block, tier, stored)

        self.device = LRUBlockCache(device_capacity_blocks, hook("device", True), hook("device", False))
        self.host = LRUBlockCache(host_capacity_blocks, hook("host", True), hook("host", False))

    def match(self, blocks: Sequence[BlockId]) -> tuple[int, int]:
        """(device blocks, host blocks) of the longest prefix held: device ones first."""
        num_device = self.device.match(blocks)
        if self.host.capacity_blocks == 0:
            return num_device, 0
        num_host = 0
        for block in blocks[num_device:]:
            if block in self.host or block in self.device:
                num_host += 1
            else:
                break
        return num_device, num_host

    def store_request(self, blocks: Sequence[BlockId]) -> None:
        """Blocks of a finished prefill land on the device; device evictions go to the host."""
        for block in blocks:
            if block in self.host:
                self.host.discard(block)
        for evicted in self.device.touch_request(blocks):
            if self.host.capacity_blocks > 0:
                self.host.put(evicted)


class OracleCache:
    """One infinite cache that sees every request in arrival order: the hit-rate ceiling."""

    def __init__(self) -> None:
        self._seen: set[BlockId] = set()

    def hit_blocks(self, blocks: Sequence[BlockId]) -> int:
        """Leading blocks seen before; then remember all of ``blocks``."""
        hit = longest_prefix(blocks, self._seen.__contains__)
        self._seen.update(blocks)
        return hit
