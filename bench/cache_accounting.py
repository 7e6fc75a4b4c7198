"""Where a real cluster's prefix-cache hits went: the oracle, the placement, the engines.

Owns the cache accounting of ``bench/serve_compare.py``, from the requests' token
ids in the order they were sent:
- ``oracle_cached_tokens``: what an ideal cluster serves from cache, each distinct prefix
  block prefilled once per cluster (infinite cache, any placement).
- ``placement_cached_tokens``: what the cluster would serve with the placement it actually
  chose (which replica served each request) and infinite caches: a prefix block is prefilled
  once per replica it was sent to, so oracle - placement is the cost of the routing's copies.
- ``cache_breakdown``: both beside the tokens the engines reported (``cached_tokens``), so
  placement - served is what the replicas lost after routing (LRU eviction, siblings that ran
  before the blocks they share were computed), and per replica the distinct prefix blocks
  it was sent (more than its KV pool holds forces eviction).

Every figure caps a hit as the engine does: the last prompt token is always computed, so a
prompt hits at most ``(len - 1) // block_size`` blocks. Block identity is the chain of
token blocks (Python's ``hash`` of the parent and the tokens; not the cluster's block hash:
no model id or salt, these only compare prompts of one run).
"""

from __future__ import annotations

from collections.abc import Sequence


def block_keys(ids: Sequence[int], block_size: int) -> list[int]:
    """One chained key per full block of ``ids``: equal keys mean equal prefixes."""
    keys, parent = [], None
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start : start + block_size])))
        keys.append(parent)
    return keys


def _hit_tokens(keys: Sequence[int], seen: set, num_prompt_tokens: int, block_size: int) -> int:
    num_hit = 0
    while num_hit < len(keys) and keys[num_hit] in seen:
        num_hit += 1
    return min(num_hit, (num_prompt_tokens - 1) // block_size) * block_size


def oracle_cached_tokens(prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """Per prompt, the tokens an ideal cluster serves from cache: its leading full blocks that
    an earlier prompt (in send order) already had, i.e. each distinct prefix block prefilled
    once per cluster, capped as the engine caps hits."""
    seen: set = set()
    out = []
    for ids in prompts:
        keys = block_keys(ids, block_size)
        out.append(_hit_tokens(keys, seen, len(ids), block_size))
        seen.update(keys)
    return out


def placement_cached_tokens(
    prompts: Sequence[Sequence[int]], replicas: Sequence[str | None], block_size: int
) -> list[int]:
    """Per prompt, the tokens its replica would serve from cache if it never evicted: the
    leading blocks an earlier prompt sent to the same replica had. ``replicas[i]`` served
    ``prompts[i]``; a prompt with no known replica counts as sent to a replica of its own."""
    seen_by_replica: dict[str | None, set] = {}
    out = []
    for ids, replica in zip(prompts, replicas, strict=True):
        seen = seen_by_replica.setdefault(replica, set()) if replica is not None else set()
        keys = block_keys(ids, block_size)
        out.append(_hit_tokens(keys, seen, len(ids), block_size))
        seen.update(keys)
    return out


def distinct_prefix_blocks(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Full blocks shared by at least two prompts (what a cache must hold to serve every hit)."""
    return len(_shared_keys(prompts, block_size))


def cache_breakdown(
    prompts: Sequence[Sequence[int]],
    replicas: Sequence[str | None],
    served_cached_tokens: Sequence[int | None],
    block_size: int,
) -> dict:
    """The oracle's cached tokens, the placement's and the engines', for requests in the order
    they were sent, plus per replica the distinct shared prefix blocks it was sent.

    ``lost_to_placement`` = oracle - placement (prefills of a prefix on a second replica);
    ``lost_after_routing`` = placement - served (evicted before reuse, or computed again by a
    sibling that ran before the blocks existed). A request the server reported no
    ``cached_tokens`` for counts as 0 served."""
    oracle = sum(oracle_cached_tokens(prompts, block_size))
    placement = sum(placement_cached_tokens(prompts, replicas, block_size))
    served = sum(n or 0 for n in served_cached_tokens)
    shared = _shared_keys(prompts, block_size)
    blocks_by_replica: dict[str, set] = {}
    for ids, replica in zip(prompts, replicas, strict=True):
        if replica is not None:
            blocks = blocks_by_replica.setdefault(replica, set())
            blocks.update(k for k in block_keys(ids, block_size) if k in shared)
    return {
        "oracle_cached_tokens": oracle,
        "placement_cached_tokens": placement,
        "served_cached_tokens": served,
        "lost_to_placement_tokens": oracle - placement,
        "lost_after_routing_tokens": placement - served,
        "shared_prefix_blocks_by_replica": {
            r: len(b) for r, b in sorted(blocks_by_replica.items())
        },
    }


def _shared_keys(prompts: Sequence[Sequence[int]], block_size: int) -> set:
    counts: dict = {}
    for ids in prompts:
        for key in block_keys(ids, block_size):
            counts[key] = counts.get(key, 0) + 1
    return {k for k, n in counts.items() if n > 1}
