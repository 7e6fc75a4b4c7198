"""The ``prefix`` routing policy: minimum predicted TTFT among the replicas under a load bound.

Owns ``PrefixPolicy``, ``CopyPrice``, ``RecentCounts`` and ``LOAD_BOUND_SLACK_REQUESTS``; the
interface and the TTFT model it prices with are ``router.policy``'s. Two steps:
1. Load bound. Candidates are the replicas whose count of requests this router recently
   sent them (``RecentCounts``, a decayed window of ``load_window_per_replica`` decisions
   per replica) stays within ``max_load_ratio`` x the mean + ``LOAD_BOUND_SLACK_REQUESTS``
   after this one (bounded-load hashing), or that are no more loaded right now
   (``router.policy.load_rank``) than the least loaded replica under the bound: the counts
   see only this router's share of the traffic (each ingress replica routes with its own),
   and a replica no busier than the others is not being piled on, whatever this router sent
   it lately. A hot prefix whose holder is at the bound and busier goes to the cheapest
   other replica, which then holds a copy and shares it. None turns this off. When the
   bound excluded a cheaper replica the reason is ``LOAD_BOUND``.
2. Price. Every candidate costs ``TTFTModel.predicted_ttft_s`` with ``miss_cost_factor``;
   with ``kv_pull_tokens_per_s`` set, the part of the prompt a peer holds on its device and
   the candidate lacks is priced as a pull from that peer instead of a prefill, and the
   ``Decision`` for such a replica names the peer and the blocks (``pull_from``,
   ``pull_blocks``): the replica performs the pull it was priced with. A candidate that would
   prefill a copy of the longest prefix another candidate holds is charged only part of that
   prefill (``CopyPrice``): the copy serves the prefix's later requests too, which can then
   choose between its holders by queue, so a prefix the router sees often is copied as soon
   as its holder's queue outgrows the copy's share (each prefix's recent requests are counted
   per deepest held block in the same decayed window as the load bound).
   A request on a LoRA adapter is also charged, on a candidate without the adapter in a
   device slot, the adapter's load (``router.policy.adapter_load_s``), weighted like a miss's
   prefill by ``miss_cost_factor`` (the load runs inside the replica's step, delaying the
   requests that share it): an adapter's requests gather where it is loaded until a holder's
   queue costs more than the load. A candidate the router just sent the adapter counts as
   holding it (``routing.Router`` merges ``RecentAdapters`` into the views).
   Candidates within ``tie_tolerance_s`` of the minimum tie; a unique winner is ``PREFIX`` (it
   holds a prefix) or ``SHORTEST_QUEUE`` (it holds none). Ties prefer the longest match, then a
   replica holding the request's adapter, then the least loaded replica
   (``router.policy.load_rank``: the fewest prefill tokens queued, then the fewest requests),
   then the fewest recently sent (spreads new prefixes, like SGLang's smallest tree), then
   rendezvous (highest random weight) hashing of the first block: ``TIE``, or ``COLD`` when no
   candidate holds anything. With equal caches every candidate ties on the match, and the
   price's decode-step terms (a rate measured at another batch size) can bring replicas with
   unequal queues within the tolerance: the queue, not the request count, then decides.
How it fails: the bound trades hits for balance. A prefix popular enough to exceed the
bound on one replica is re-prefilled on another (its hit rate drops by one prefill per
copy), and routers that share no history balance only their own traffic. The copy price
assumes the copy stays cached while the prefix's requests keep coming; a copy evicted
sooner (a cache too small for the workload's prefixes) was paid for and not used. The adapter
price knows which adapters a replica holds, not whether its slots are all held by running
requests of other adapters: such a replica makes the request wait for a slot, beyond the
price, and a holder's adapter may have been evicted since its last stats.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.config import RouterConfig
from router.index_types import Match
from router.policy import (
    Decision,
    ReplicaView,
    RoutingReason,
    TTFTModel,
    adapter_load_s,
    check_request,
    load_rank,
    num_matched,
    peer_device_blocks,
    pull_source,
    rendezvous_pick,
)
from router.protocol import BlockHash, ReplicaStats

# Additive room of the load bound, in requests: early on (or at low traffic) the mean recent
# count is near 0 and a pure ratio would spill a prefix's second request; 2 lets a prefix's
# first few requests stay together before the ratio takes over.
LOAD_BOUND_SLACK_REQUESTS = 2.0


class RecentCounts:
    """Requests this router sent to each replica, decayed per decision (not per second).

    Each decision multiplies every count by ``1 - 1 / (window_per_replica * num_replicas)``
    and adds 1 to the chosen replica, so the counts sum to about ``window_per_replica`` per
    replica: the recent rate, with no clock (the simulator and the cluster agree) and in O(1)
    per decision (one global scale, renormalized when it grows large). A replica that joins
    starts at 0 and catches up within a window instead of being flooded until its lifetime
    count matches the others'. Not thread-safe: the policy holds its lock around it.
    """

    _RENORMALIZE_AT = 1e12

    def __init__(self, window_per_replica: float) -> None:
        self.window_per_replica = window_per_replica
        self._raw: dict[str, float] = {}
        self._scale = 1.0  # true count = raw / scale

    def get(self, replica_id: str) -> float:
        return self._raw.get(replica_id, 0.0) / self._scale

    def add(self, replica_id: str, num_replicas: int, amount: float = 1.0) -> None:
        self._scale /= 1.0 - 1.0 / (self.window_per_replica * max(num_replicas, 1))
        self._raw[replica_id] = self._raw.get(replica_id, 0.0) + amount * self._scale
        if self._scale > self._RENORMALIZE_AT:
            self._raw = {k: v / self._scale for k, v in self._raw.items() if v / self._scale > 1e-6}
            self._scale = 1.0


@dataclass(frozen=True)
class CopyPrice:
    """What a copy of the longest held prefix is worth to one request's choice.

    A replica that lacks the prefix prefills a copy once; the prefix's later requests can
    then choose between its holders by queue. The copy's prefill (with ``miss_cost_factor``)
    is set against the queueing it saves the requests that will use it, each saving about
    the queue gap this request sees: its ``reuse``, the prefix's requests in the recent window
    shared among its holders once the copy exists, for as long as the replica would keep the
    copy. A replica whose empty blocks hold the copy keeps it; one that must evict for it keeps
    an unused block for ``kv_lru_age`` of its requests, against the window's
    ``load_window_per_replica``. The prefill is then charged ``1 / (1 + reuse)`` of itself."""

    prefix_tokens: int
    """Prompt tokens of the longest prefix some candidate holds."""
    reuse: float
    """The prefix's recent requests per holder once copied, on a replica that keeps it."""

    def discount(
        self, stats: ReplicaStats, copy_tokens: int, block_size: int, window_requests: float
    ) -> float:
        """Share of the copy's prefill price taken off a replica with these stats, which lacks
        ``copy_tokens`` tokens of the prefix."""
        if copy_tokens <= stats.num_empty_kv_blocks * block_size:
            kept = 1.0
        else:
            kept = min(1.0, stats.kv_lru_age / window_requests)
        reuse = self.reuse * kept
        return reuse / (1.0 + reuse)


class PrefixPolicy:
    """Minimum predicted TTFT among the replicas under the load bound; ties by longest match,
    then least loaded, then fewest recently sent, then rendezvous."""

    name = "prefix"

    def __init__(self, config: RouterConfig) -> None:
        self.model = TTFTModel(config)
        self.tie_tolerance_s = config.tie_tolerance_s
        self.miss_cost_factor = config.miss_cost_factor
        self.max_load_ratio = config.max_load_ratio
        self.copy_pricing = config.copy_pricing
        self.pulls = config.kv_pull_tokens_per_s is not None
        self._recent = RecentCounts(config.load_window_per_replica)
        self.window_requests = config.load_window_per_replica
        self._heat = RecentCounts(config.load_window_per_replica)
        """Deepest held block hash -> requests that matched up to it, in the same window."""
        self._lock = threading.Lock()

    def _under_bound(self, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Replicas that may take one more request without their recent count passing
        ``max_load_ratio`` times the mean plus ``LOAD_BOUND_SLACK_REQUESTS`` (bounded-load
        consistent hashing, Mirrokni et al. 2018, over the router's recent counts)."""
        if self.max_load_ratio is None or len(replicas) == 1:
            return list(replicas)
        counts = [self._recent.get(v.replica_id) for v in replicas]
        bound = self.max_load_ratio * sum(counts) / len(replicas) + LOAD_BOUND_SLACK_REQUESTS
        under = [n + 1.0 <= bound for n in counts]
        if all(under):
            return list(replicas)
        # The counts see only this router's traffic: a replica over the bound stays a candidate
        # while it is no more loaded right now than the least loaded replica under it.
        least_under = min(load_rank(v) for v, ok in zip(replicas, under, strict=True) if ok)
        return [
            v for v, ok in zip(replicas, under, strict=True) if ok or load_rank(v) <= least_under
        ]

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        replicas: Sequence[ReplicaView],
        matches: Mapping[str, Match],
        *,
        lora_name: str | None = None,
    ) -> Decision:
        check_request(replicas, num_prompt_tokens)
        peers = peer_device_blocks(matches) if self.pulls else None
        load_s = adapter_load_s(replicas, lora_name)
        with self._lock:
            key, copy = self._copy_price(block_hashes, num_prompt_tokens, replicas, matches)
            costs = {
                v.replica_id: self._cost(v, matches, num_prompt_tokens, peers, copy, load_s)
                for v in replicas
            }
            candidates = self._under_bound(replicas)
            view, longest, reason = self._pick(block_hashes, candidates, matches, costs, load_s)
            if (
                len(candidates) < len(replicas)
                and min(costs.values()) + self.tie_tolerance_s < costs[view.replica_id]
            ):
                reason = RoutingReason.LOAD_BOUND  # the bound, not the price, decided
            self._recent.add(view.replica_id, len(replicas))
            self._heat.add(key, len(replicas))
        ttft_s = load_s[view.replica_id] + self.model.predicted_ttft_s(
            view, matches.get(view.replica_id), num_prompt_tokens, 1.0, _peer(peers, view)
        )
        source = pull_source(matches, view.replica_id) if self.pulls else None
        if source is None or not block_hashes:
            return Decision(view.replica_id, ttft_s, longest, reason)
        peer_id, peer_blocks = source  # priced as a pull above: the replica performs it
        num_blocks = min(peer_blocks, len(block_hashes))
        return Decision(view.replica_id, ttft_s, longest, reason, peer_id, num_blocks)

    def _cost(
        self,
        view: ReplicaView,
        matches: Mapping[str, Match],
        num_prompt_tokens: int,
        peers: Mapping[str, int] | None,
        copy: CopyPrice | None = None,
        load_s: Mapping[str, float] | None = None,
    ) -> float:
        """``view``'s predicted TTFT with ``miss_cost_factor`` (its adapter load in
        ``load_s`` weighted like a miss), less ``copy``'s discount when ``view`` would
        prefill a copy of the prefix another replica holds."""
        peer_blocks = _peer(peers, view)
        match = matches.get(view.replica_id)
        cost_s = self.model.predicted_ttft_s(
            view, match, num_prompt_tokens, self.miss_cost_factor, peer_blocks
        )
        if load_s is not None:
            cost_s += self.miss_cost_factor * load_s[view.replica_id]
        if copy is None:
            return cost_s
        own_blocks = max(0 if match is None else match.num_blocks, peer_blocks)
        copy_tokens = copy.prefix_tokens - own_blocks * self.model.block_size
        if copy_tokens <= 0:
            return cost_s
        stats = view.stats
        discount = copy.discount(stats, copy_tokens, self.model.block_size, self.window_requests)
        rate = self.model.prefill_tokens_per_s(stats)
        return cost_s - discount * self.miss_cost_factor * copy_tokens / rate

    def _copy_price(
        self,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        replicas: Sequence[ReplicaView],
        matches: Mapping[str, Match],
    ) -> tuple[BlockHash, CopyPrice | None]:
        """The key this request's heat counts under (the deepest block a candidate holds;
        ``b""`` when none holds any) and the price of a copy of that prefix (None when every
        candidate holds it, it has no recent requests, or ``copy_pricing`` is off)."""
        candidate_ids = {v.replica_id for v in replicas}
        held = [m.num_blocks for rid, m in matches.items() if rid in candidate_ids]
        longest = min(max(held, default=0), len(block_hashes))
        if longest == 0:
            return b"", None
        key = block_hashes[longest - 1]
        num_holders = sum(blocks >= longest for blocks in held)
        reuse = self._heat.get(key) / (num_holders + 1)
        if num_holders == len(replicas) or reuse <= 0 or not self.copy_pricing:
            return key, None
        prefix_tokens = min(longest * self.model.block_size, num_prompt_tokens)
        return key, CopyPrice(prefix_tokens, reuse)

    def _pick(
        self,
        block_hashes: Sequence[BlockHash],
        replicas: Sequence[ReplicaView],
        matches: Mapping[str, Match],
        costs: Mapping[str, float],
        load_s: Mapping[str, float] | None = None,
    ) -> tuple[ReplicaView, int, RoutingReason]:
        """The cheapest of ``replicas`` by ``costs`` (replica id -> ``_cost``, after
        tie-breaks), its matched blocks and the reason."""
        scored = [(costs[v.replica_id], v) for v in replicas]
        best_s = min(score for score, _ in scored)
        tied = [v for score, v in scored if score <= best_s + self.tie_tolerance_s]
        longest = max(num_matched(matches, v.replica_id) for v in tied)
        tied = [v for v in tied if num_matched(matches, v.replica_id) == longest]
        if len(tied) == 1:
            reason = RoutingReason.PREFIX if longest > 0 else RoutingReason.SHORTEST_QUEUE
            return tied[0], longest, reason
        if load_s is not None:  # an adapter load within the tolerance: its holders first
            tied = [v for v in tied if load_s[v.replica_id] == 0.0] or tied
        # Equal cost and equal match: the least loaded (``load_rank``: queued prefill first),
        # then the least recently used (spreads new prefixes like SGLang's smallest tree),
        # then rendezvous on the first block, so a cold prefix lands where every router with
        # the same history agrees.
        least = min(load_rank(v) for v in tied)
        tied = [v for v in tied if load_rank(v) == least]
        fewest = min(round(self._recent.get(v.replica_id)) for v in tied)
        tied = [v for v in tied if round(self._recent.get(v.replica_id)) == fewest]
        key = block_hashes[0] if block_hashes else b""
        chosen_id = rendezvous_pick(key, [v.replica_id for v in tied])
        view = next(v for v in tied if v.replica_id == chosen_id)
        any_match = any(num_matched(matches, v.replica_id) for v in replicas)
        return view, longest, (RoutingReason.TIE if any_match else RoutingReason.COLD)


def _peer(peers: Mapping[str, int] | None, view: ReplicaView) -> int:
    """Leading device blocks a peer of ``view`` holds (0 with pulls off)."""
    if peers is None:
        return 0
    return peers.get(view.replica_id, peers[""])
