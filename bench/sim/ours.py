"""Adapter that runs prefixserve's own routing policy (``router.policy``) inside the simulator.

The policy itself is imported, never re-written: ``make_policy(RouterConfig(policy="prefix"))``
and its ``choose(block_hashes, num_prompt_tokens, replicas, matches)``. The adapter supplies
what the cluster would:

- ``matches``: the exact blocks each simulated replica holds (what its KV events report), plus
  *speculative* entries: like ``PrefixIndex.record_speculative``, a routing decision counts as
  the chosen replica holding the request's blocks for ``RouterConfig.speculative_ttl_s``
  (simulated) seconds, sized to the calibrated prefill rate (``SPECULATIVE_TTL_QUEUE_TOKENS``).
  Same leading-run semantics as ``router.embedded_index``: device blocks (speculative
  included) first, then host blocks. ``speculative=False`` turns that off.
- ``ReplicaView``: ``ReplicaStats`` from the replica's simulated state (waiting and running
  requests, KV usage and capacity, the calibrated prefill/decode/host rates, prompt tokens
  queued for prefill, the measured decode time of its finished requests) and its
  ``ReplicaLoad``, exact: the simulator knows every request's state when it
  decides, as a router whose tracker hears every event at once would. Views are rebuilt only
  when a replica changed (``SimViews``; ``bench/sim/baselines.py`` runs ``router.baselines``
  on the same views).
- Several routers (``num_routers``), as a cluster runs one per ingress replica: each its own
  policy, whose state (the recent counts its load bound reads, the prefix heat its copy
  pricing reads) sees only the requests dealt to it, in turn, as Serve's proxy spreads them
  over the ingress replicas. They share the matches and the speculative entries (one index)
  and the views (the in-flight board shows each router the others' requests).

Block ids are handed to the policy as 16-byte big-endian values, the shape of real hashes.
Failure modes: if ``router.policy`` is missing or its interface changed, construction raises
``ImportError``/``TypeError`` at once rather than mid-run.
"""

from __future__ import annotations

from router.config import RouterConfig
from router.index_types import Match
from router.load import ReplicaLoad
from router.policies import make_policy
from router.policy import ReplicaView
from router.protocol import HASH_NUM_BYTES, ReplicaStats


def sim_router_config(
    sim, policy: str, pull_price_factor: float | None = None, **overrides
) -> RouterConfig:
    """The ``RouterConfig`` an operator would give ``policy`` on the simulated engine: its
    calibrated rates as the defaults, the block size and seed of the run, the pull rate when
    the simulated replicas pull KV from peers (divided by ``pull_price_factor``, default
    ``PULL_PRICE_FACTOR``); ``overrides`` replace fields (tuning runs)."""
    rates = sim.rates
    pull = sim.config.pull
    factor = PULL_PRICE_FACTOR if pull_price_factor is None else pull_price_factor
    fields = dict(
        kv_pull_tokens_per_s=None if pull is None else pull.pull_tokens_per_s / factor,
    )
    fields.update(overrides)
    return RouterConfig(
        policy=policy,
        block_size=sim.config.block_size,
        default_prefill_tokens_per_s=rates.prefill_tokens_per_s,
        default_decode_step_s=rates.decode_step_base_s,
        default_host_to_device_tokens_per_s=rates.host_to_device_tokens_per_s,
        speculative_ttl_s=max(
            RouterConfig.speculative_ttl_s,
            SPECULATIVE_TTL_QUEUE_TOKENS / rates.prefill_tokens_per_s,
        ),
        seed=sim.config.seed,
        **fields,
    )


def block_hashes(block_ids) -> list[bytes]:
    """Simulated block ids in the shape of real hashes (16-byte big-endian)."""
    return [b.to_bytes(HASH_NUM_BYTES, "big") for b in block_ids]


class SimViews:
    """A ``ReplicaView`` per simulated replica, rebuilt only when the replica changed."""

    def __init__(self, sim) -> None:
        self._views: list = [None] * len(sim.replicas)
        self._versions = [-1] * len(sim.replicas)

    def all(self, sim) -> list[ReplicaView]:
        return [self.view(sim, r) for r in sim.replicas]

    def view(self, sim, replica) -> ReplicaView:
        if self._versions[replica.index] != replica.version:
            rates = sim.rates
            num_running = replica.num_running + replica.num_prefills
            step_s = rates.decode_step_s(max(replica.num_running, 1))
            stats = ReplicaStats(
                num_waiting=sim.num_waiting(replica),
                num_running=num_running,
                kv_usage=sim.kv_usage(replica),
                prefill_tokens_per_s=rates.prefill_tokens_per_s,
                decode_tokens_per_s=max(replica.num_running, 1) / step_s,
                num_queued_prefill_tokens=replica.num_queued_prefill_tokens,
                host_to_device_tokens_per_s=(
                    rates.host_to_device_tokens_per_s if sim.config.host_capacity_blocks else 0.0
                ),
                num_empty_kv_blocks=replica.cache.num_empty_blocks,
                kv_lru_age=replica.cache.lru_age,
                num_kv_blocks=sim.config.capacity_blocks,
                decode_s=replica.metrics.decode_s,
            )
            load = ReplicaLoad(
                num_queued=stats.num_waiting + replica.num_prefills,
                queued_prefill_tokens=replica.num_queued_prefill_tokens,
                num_running=replica.num_running,
            )
            self._views[replica.index] = ReplicaView(replica.replica_id, stats, load)
            self._versions[replica.index] = replica.version
        return self._views[replica.index]


class OursPolicy:
    name = "prefix"

    def __init__(
        self,
        speculative: bool = True,
        router_config: RouterConfig | None = None,
        router_overrides: dict | None = None,
        pull_price_factor: float | None = None,
        num_routers: int = 1,
    ) -> None:
        if num_routers < 1:
            raise ValueError(f"num_routers must be at least 1, got {num_routers}")
        self.num_routers = num_routers
        self.router_config = router_config
        self.router_overrides = router_overrides or {}
        self.pull_price_factor = pull_price_factor
        self.speculative = speculative
        self._policies: list = []
        self._num_routed = 0
        self._views: SimViews | None = None
        self._index_of: dict[str, int] = {}
        self._speculative: list[dict] = []  # per replica: block -> expiry (simulated seconds)

    def _setup(self, sim) -> None:
        if self.router_config is None:
            self.router_config = sim_router_config(
                sim, "prefix", self.pull_price_factor, **self.router_overrides
            )
        self._policies = [make_policy(self.router_config) for _ in range(self.num_routers)]
        self._views = SimViews(sim)
        self._index_of = {r.replica_id: r.index for r in sim.replicas}
        self._speculative = [{} for _ in sim.replicas]

    def _matches(self, sim, blocks) -> dict[str, Match]:
        exact = sim.exact_matches(blocks)
        if self.speculative and blocks:
            head = blocks[0]
            for i, spec in enumerate(self._speculative):
                if head in spec and i not in exact:
                    exact[i] = (0, 0)
        result = {}
        for i, (device, host) in exact.items():
            spec = self._speculative[i] if self.speculative else None
            if spec and device < len(blocks) and spec.get(blocks[device], -1.0) > sim.now_s:
                device, host = self._with_speculative(sim, i, blocks, spec, device)
            if device + host:
                result[sim.replicas[i].replica_id] = Match(device_blocks=device, host_blocks=host)
        return result

    @staticmethod
    def _with_speculative(sim, i: int, blocks, spec: dict, start: int) -> tuple[int, int]:
        """Leading run counting unexpired speculative entries as device blocks (from ``start``,
        the exact device run), then host blocks: ``router.embedded_index``'s rule."""
        cache, now_s = sim.replicas[i].cache, sim.now_s
        n = start
        while n < len(blocks) and (blocks[n] in cache or spec.get(blocks[n], -1.0) > now_s):
            n += 1
        num_device = n
        while n < len(blocks) and (
            blocks[n] in cache.host or blocks[n] in cache or spec.get(blocks[n], -1.0) > now_s
        ):
            n += 1
        return num_device, n - num_device

    def choose(self, sim, req) -> int:
        if not self._policies:
            self._setup(sim)
        views = self._views.all(sim)
        matches = self._matches(sim, req.block_ids)
        hashes = block_hashes(req.block_ids)
        policy = self._policies[self._num_routed % self.num_routers]
        self._num_routed += 1
        decision = policy.choose(hashes, req.num_prompt_tokens, views, matches)
        chosen = self._index_of[decision.replica_id]
        if self.speculative:
            expiry_s = sim.now_s + self.router_config.speculative_ttl_s
            spec = self._speculative[chosen]
            if len(spec) > _PRUNE_THRESHOLD:
                self._speculative[chosen] = spec = {b: t for b, t in spec.items() if t > sim.now_s}
            for block in req.block_ids:
                spec[block] = expiry_s
        return chosen


# An operator sets ``speculative_ttl_s`` to cover the time until the KV events arrive, i.e.
# the queue plus the prefill; on a slow engine the 5 s default is shorter than one prefill
# (a 1k-token prompt takes ~7 s on the calibrated CPU), so the adapter sizes it to the time
# this many queued prompt tokens take at the calibrated rate (55 s on the CPU, 5 s on a GPU).
SPECULATIVE_TTL_QUEUE_TOKENS = 8192

# The router prices a pull at this many times the transfer time (RouterConfig's
# kv_pull_tokens_per_s = the transfer rate / this): a copy also takes cache space that evicts
# other prefixes, which the TTFT model does not see. Tuned on the simulator with pulls on
# (bench/results/sim_20261124_pulls.json, 64 replicas): at 1 the router copies prefixes so
# freely that the capacity-bound Mooncake workload falls to 91.5% of the oracle hit rate; 40
# gives 93.8% and the lowest p90 TTFT on every workload; 100 gives 95.1% but loses
# single_hot_prefix's p90 (2.04 s vs round robin's 1.97 s) and at 128 replicas stays at 94%.
PULL_PRICE_FACTOR = 40.0

# Same reason as router.embedded_index: prune expired speculative entries only past a size,
# so recording stays amortized O(1).
_PRUNE_THRESHOLD = 4096
