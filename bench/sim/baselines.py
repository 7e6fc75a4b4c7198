"""Baseline routing policies for the simulator: load-only ones, SGLang's and llm-d's.

Each policy has a ``name`` and ``choose(sim, request) -> replica index``; it may also define
``on_finished(sim, request, replica_index)``. They read only what their real counterpart can:

- ``random``: nothing (the simulator's seeded rng).
- ``round_robin``, ``least_loaded``, ``pow2``: ``router.baselines``' own classes, run
  unchanged on the same ``ReplicaView``s ``bench/sim/ours.py`` builds, so simulated and
  deployed baselines break ties the same way: round robin walks the replicas in replica-id
  order, least loaded (``router.policy.load_rank``: queued prefill tokens, then requests)
  ties by rendezvous on the first block, pow2 draws from its own rng seeded with the run's
  seed and keeps the first draw unless the second is strictly less loaded. Matches are not
  computed for them.
- ``sglang_cache_aware``: SGLang router's cache-aware policy, re-implemented from its docs.
  An *approximate* tree per replica of what the router itself sent there (never told about
  evictions), kept here at block granularity (block ids are prefix-chained, so a set of ids is
  a radix tree). If the load is imbalanced, i.e. ``max - min > balance_abs_threshold`` (64) and
  ``max > balance_rel_threshold (1.5) * min`` over in-flight counts, route to the least loaded.
  Else take the longest tree match; if ``matched / prompt tokens > cache_threshold`` (0.3) route
  there (ties: least loaded), otherwise to the replica with the smallest tree. The request is
  inserted into the chosen replica's tree either way. ``max_tree_blocks`` (None: unbounded, as
  SGLang's huge default is for this scale) bounds each tree with LRU eviction.
- ``llmd_precise``: llm-d's precise prefix-cache scheduling: the exact index of device blocks
  (KV events), scorers ``prefix`` (matched blocks) and ``queue`` (waiting requests), each
  min-max normalized across replicas to [0, 1], and ``kv-cache`` (1 - KV usage, already in
  [0, 1]), weighted 2 / 1 / 1; the maximum total wins, ties at random.

Failure modes: thresholds are validated at construction (``ValueError``).
"""

from __future__ import annotations

from collections import OrderedDict

from bench.sim.cache import longest_prefix
from bench.sim.ours import SimViews, block_hashes, sim_router_config
from router.policies import make_policy


def _argmin_random(values, rng) -> int:
    best = min(values)
    candidates = [i for i, v in enumerate(values) if v == best]
    return candidates[0] if len(candidates) == 1 else rng.choice(candidates)


class RandomPolicy:
    name = "random"

    def choose(self, sim, req) -> int:
        return sim.rng.randrange(len(sim.replicas))


class _RouterBaseline:
    """One of ``router.baselines``' policies (``name`` is its ``RouterConfig.policy``) on the
    simulator's views. They ignore matches, so none are computed, and only the first block's
    hash (their rendezvous key) is handed over."""

    name = ""

    def __init__(self) -> None:
        self._policy = None
        self._views: SimViews | None = None
        self._index_of: dict[str, int] = {}

    def choose(self, sim, req) -> int:
        if self._policy is None:
            self._policy = make_policy(sim_router_config(sim, self.name))
            self._views = SimViews(sim)
            self._index_of = {r.replica_id: r.index for r in sim.replicas}
        views = self._views.all(sim)
        decision = self._policy.choose(
            block_hashes(req.block_ids[:1]), req.num_prompt_tokens, views, {}
        )
        return self._index_of[decision.replica_id]


class RoundRobinPolicy(_RouterBaseline):
    name = "round_robin"


class LeastLoadedPolicy(_RouterBaseline):
    name = "least_loaded"


class PowerOfTwoPolicy(_RouterBaseline):
    name = "pow2"


class SGLangCacheAwarePolicy:
    name = "sglang_cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_blocks: int | None = None,
    ) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ValueError("cache_threshold must be in [0, 1]")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0, balance_rel_threshold >= 1")
        if max_tree_blocks is not None and max_tree_blocks <= 0:
            raise ValueError("max_tree_blocks must be positive or None")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_blocks = max_tree_blocks
        self._trees: list[OrderedDict] = []
        self._owners: dict = {}  # block -> replicas whose tree holds it

    def _insert(self, replica: int, blocks) -> None:
        tree = self._trees[replica]
        for block in reversed(blocks):  # head most recent: LRU evicts leaves first
            if block in tree:
                tree.move_to_end(block)
                continue
            tree[block] = None
            self._owners.setdefault(block, set()).add(replica)
            if self.max_tree_blocks is not None and len(tree) > self.max_tree_blocks:
                old, _ = tree.popitem(last=False)
                owners = self._owners[old]
                owners.discard(replica)
                if not owners:
                    del self._owners[old]

    def choose(self, sim, req) -> int:
        if not self._trees:
            self._trees = [OrderedDict() for _ in sim.replicas]
        loads = [r.num_inflight for r in sim.replicas]
        max_load, min_load = max(loads), min(loads)
        imbalanced = (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        )
        blocks = req.block_ids
        if imbalanced:
            chosen = loads.index(min_load)
        else:
            best, best_matched = None, 0
            for replica in self._owners.get(blocks[0], ()) if blocks else ():
                matched = longest_prefix(blocks, self._trees[replica].__contains__)
                if matched > best_matched or (
                    matched == best_matched and best is not None and loads[replica] < loads[best]
                ):
                    best, best_matched = replica, matched
            match_rate = best_matched * sim.config.block_size / req.num_prompt_tokens
            if best is not None and match_rate > self.cache_threshold:
                chosen = best
            else:
                sizes = [len(tree) for tree in self._trees]
                chosen = sizes.index(min(sizes))
        self._insert(chosen, blocks)
        return chosen


class LlmdPrecisePolicy:
    name = "llmd_precise"

    def __init__(self, prefix_weight=2.0, queue_weight=1.0, kv_cache_weight=1.0) -> None:
        if min(prefix_weight, queue_weight, kv_cache_weight) < 0:
            raise ValueError("scorer weights must be >= 0")
        self.weights = (prefix_weight, queue_weight, kv_cache_weight)

    @staticmethod
    def _normalized(values: list[float], higher_is_better: bool) -> list[float]:
        lo, hi = min(values), max(values)
        if hi == lo:
            return [1.0] * len(values)
        if higher_is_better:
            return [(v - lo) / (hi - lo) for v in values]
        return [(hi - v) / (hi - lo) for v in values]

    def choose(self, sim, req) -> int:
        replicas = sim.replicas
        prefix = [0.0] * len(replicas)
        for i, (device, host) in sim.exact_matches(req.block_ids).items():
            prefix[i] = float(device + host)
        queue = [float(sim.num_waiting(r)) for r in replicas]
        w_prefix, w_queue, w_kv = self.weights
        scores = [
            w_prefix * p + w_queue * q + w_kv * k
            for p, q, k in zip(
                self._normalized(prefix, True),
                self._normalized(queue, False),
                [1.0 - sim.kv_usage(r) for r in replicas],
                strict=True,
            )
        ]
        return _argmin_random([-s for s in scores], sim.rng)
