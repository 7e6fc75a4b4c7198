"""``BlockPool``: where KV lives. Reference counts, the prefix cache, eviction, KV events.

Invariants (checked by ``check_invariants``, which the stress test calls every step):
- A block is either referenced (``ref_count > 0``) or free, never both; a free block is in
  exactly one of two queues: the empty ones (holding no prefix) and the cached ones.
- Allocation takes empty blocks first (they cost the cache nothing), then cached ones in
  eviction order: least recently freed first, and when a request frees a chain its tail goes
  in before its parent, so a chain is evicted from the end.
- ``_cached`` maps a block hash to the one block holding it; a cached free block stays
  matchable until it is handed out again (then its hash is dropped and a ``removed`` event
  is emitted).
- A hit is served only if the block's stored tokens equal the request's tokens, so a hash
  collision costs a recompute, never a wrong answer.

With a host tier attached (``attach_host``), a cached block that the device reuses is first
copied to host memory (``worker/host_cache.py``), and ``load_host_prefix`` brings host blocks
back on a hit. A hash lives in exactly one tier.

Allocation failures raise ``NoFreeBlocksError``; the scheduler answers them with preemption.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from router.protocol import BlockHash, EventKind, KVEvent, Tier
from worker.host_cache import HostKVCache, KVMover


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    """The tokens whose KV the block holds, kept to verify every hit."""
    num_evictions: int = 0
    """How many times the block lost a cached hash: a reader on another thread that saw the
    same count before and after copying the block read one content (``peek_cached_prefix``)."""
    released_at: int = 0
    """``BlockPool.num_releases`` when the block was last released (its last use)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_empty: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        """Free blocks that hold no prefix, in the order they were freed."""
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        """Free blocks that hold a cached prefix, least recently released first."""
        self.num_releases = 0
        """``free`` calls so far (a request's chain released): the pool's clock of use."""
        self._cached: dict[BlockHash, int] = {}
        self._events: list[KVEvent] = []
        self.num_collisions = 0
        self.host: HostKVCache | None = None

    def attach_host(self, num_slots: int, mover: KVMover) -> None:
        """Give evicted prefix blocks a second life in host memory (``num_slots`` blocks)."""
        self.host = HostKVCache(num_slots, mover, self._events)

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_empty) + len(self._free_cached)

    @property
    def num_empty_free_blocks(self) -> int:
        """Free blocks that hold no cached prefix: allocating up to this many evicts nothing."""
        return len(self._free_empty)

    @property
    def lru_age(self) -> int:
        """Chains released since the least recently used cached block was released: how long
        this cache has kept a prefix nobody used; 0 when no free block holds a prefix."""
        if not self._free_cached:
            return 0
        return self.num_releases - self.blocks[next(iter(self._free_cached))].released_at

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def find_cached_prefix(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int]
    ) -> list[Block]:
        """The longest run of leading blocks already cached whose stored tokens match."""
        if not self.enable_prefix_caching:
            return []
        hits: list[Block] = []
        bs = self.block_size
        for i, h in enumerate(block_hashes):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                self.num_collisions += 1  # same hash, other tokens: never serve it
                break
            hits.append(block)
        return hits

    def peek_cached_prefix(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int]
    ) -> list[tuple[Block, int]]:
        """``find_cached_prefix`` for a reader on another thread while the engine steps:
        (block, its ``num_evictions``) per leading hit, touching nothing (no counter, no
        reference). The caller copies the blocks, then keeps those ``still_cached`` says were
        not evicted meanwhile: a block is only rewritten after it is evicted."""
        if not self.enable_prefix_caching:
            return []
        hits: list[tuple[Block, int]] = []
        bs = self.block_size
        for i, h in enumerate(block_hashes):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            num_evictions = block.num_evictions  # read before the tokens and hash it guards
            if block.block_hash != h or block.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append((block, num_evictions))
        return hits

    @staticmethod
    def still_cached(hits: Sequence[tuple[Block, int]]) -> int:
        """How many leading ``peek_cached_prefix`` hits have not been evicted since."""
        for i, (block, num_evictions) in enumerate(hits):
            if block.num_evictions != num_evictions:
                return i
        return len(hits)

    def load_host_prefix(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int
    ) -> list[Block]:
        """Bring host blocks ``start, start + 1, ...`` back to the device while they match.

        Each returned block holds one reference. Stops at the first miss, or when no device
        block is free (allocating may evict device blocks to the host, possibly dropping a
        later host block of this same prefix: the loop checks each one when it gets there).
        """
        if self.host is None or not self.enable_prefix_caching:
            return []
        bs, loaded = self.block_size, []
        for i in range(start, len(block_hashes)):
            h, toks = block_hashes[i], token_ids[i * bs : (i + 1) * bs]
            if h not in self.host or not self.host.matches(h, toks):
                break
            try:
                [block] = self.allocate(1)
            except NoFreeBlocksError:
                break
            if h not in self.host:  # the allocation just pushed it out of the host tier
                self.free([block])
                break
            block.token_ids = self.host.load(h, block.block_id)
            block.block_hash = h
            self._cached[h] = block.block_id
            self._events.append(KVEvent(EventKind.STORED, (h,), Tier.DEVICE))
            loaded.append(block)
        return loaded

    # -- reference counting ------------------------------------------------------------------
    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cache hits (pulling free ones out of the free queue)."""
        for block in blocks:
            if block.ref_count == 0:
                queue = self._free_cached if block.block_hash is not None else self._free_empty
                del queue[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[Block]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            queue = self._free_empty or self._free_cached
            block_id, _ = queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block; the chain's tail is queued for eviction first."""
        self.num_releases += 1
        for block in reversed(blocks):
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                block.released_at = self.num_releases
                if block.block_hash is None:
                    self._free_empty[block.block_id] = None
                else:
                    self._free_cached[block.block_id] = None

    # -- the prefix cache --------------------------------------------------------------------
    def cache_block(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full, computed block. A duplicate of an already-cached hash stays private."""
        if (
            not self.enable_prefix_caching
            or block.block_hash is not None
            or block_hash in self._cached
        ):
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block.block_id
        if self.host is not None:
            self.host.discard(block_hash)  # recomputed on the device: one tier holds it
        self._events.append(KVEvent(EventKind.STORED, (block_hash,), Tier.DEVICE))

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            self._events.append(KVEvent(EventKind.REMOVED, (block.block_hash,), Tier.DEVICE))
            if self.host is not None:
                self.host.save(block.block_id, block.block_hash, block.token_ids)
            block.num_evictions += 1  # first: a concurrent reader must see it before any change
            block.block_hash = None
            block.token_ids = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            if block.block_hash is not None:
                block.num_evictions += 1
            block.block_hash, block.token_ids = None, None
        self._cached.clear()
        self._free_empty.update(self._free_cached)
        self._free_cached.clear()
        if self.host is not None:
            self.host.clear()
        self._events.append(KVEvent(EventKind.CLEARED))
        return True

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the device tier can serve now. Not what a replica re-announces: that is
        ``cluster/kv_publisher.py``'s mirror of the forwarded events, never read from the
        engine's cache by another thread."""
        return list(self._cached)

    def take_events(self) -> list[KVEvent]:
        """This step's changes, with consecutive events of one kind merged."""
        merged: list[KVEvent] = []
        for ev in self._events:
            if merged and merged[-1].kind == ev.kind and ev.kind != EventKind.CLEARED:
                merged[-1] = KVEvent(ev.kind, merged[-1].hashes + ev.hashes, ev.tier)
            else:
                merged.append(ev)
        self._events.clear()
        return merged

    def check_invariants(self) -> None:
        if self._free_empty.keys() & self._free_cached.keys():
            raise AssertionError("a block is in both free queues")
        free = set(self._free_empty) | set(self._free_cached)
        for block in self.blocks:
            in_free = block.block_id in free
            if in_free == (block.ref_count > 0) or block.ref_count < 0:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count}, in free queue {in_free}"
                )
        for block_id in self._free_empty:
            if self.blocks[block_id].block_hash is not None:
                raise AssertionError(f"block {block_id} holds a prefix but is queued as empty")
        for block_id in self._free_cached:
            if self.blocks[block_id].block_hash is None:
                raise AssertionError(f"block {block_id} holds no prefix but is queued as cached")
        for h, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != h:
                raise AssertionError(
                    f"hash map points at block {block_id} which holds another hash"
                )
        if self.host is not None:
            self.host.check_invariants()
            both = set(self._cached) & set(self.host.hashes())
            if both:
                raise AssertionError(f"{len(both)} hashes are held by both tiers")
