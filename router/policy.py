"""Routing policies' interface: which replica gets a request, priced in seconds of predicted TTFT.

Owns what the simulator and the cluster import: ``ReplicaView`` (a candidate), ``Decision``
(the answer) and its ``RoutingReason``, the ``RoutingPolicy`` protocol, the
TTFT model every policy reports with, rendezvous hashing and the small helpers the policies
share. The policies live in ``router.prefix_policy`` (``prefix``: load bound, then price) and
``router.baselines`` (``round_robin``/``least_loaded``/``pow2``, which the simulator runs
too). ``routing.Router`` combines a policy with an index; policies themselves do no I/O.

The TTFT model: ``queue_s + kv_wait_s + miss_cost_factor * miss_tokens / prefill_rate +
host_tokens / host_rate + remote_tokens / pull_rate + (one decode step if the replica is
busy)``, where ``kv_wait_s`` is the wait for KV space when the blocks the prompt needs past
the replica's device match do not fit in its free blocks (``TTFTModel.kv_wait_s``), and
``remote_tokens`` are prompt tokens past the replica's own match that a peer holds and it
would pull (only when ``RouterConfig.kv_pull_tokens_per_s`` is set; else they are misses),
and ``queue_s = queued_prefill_tokens / prefill_rate + num_queued * step_s``: the replica's
``ReplicaLoad`` (``router.load``), each queued request sharing a decode step with the running
batch (chunked prefill), one step costing ``num_running / decode_rate``. Unmeasured rates
fall back to the configured defaults; ``pooled_prefill_rate`` gives the replicas of one
deployment one measured prefill rate. A request on a LoRA adapter (``choose``'s
``lora_name``) also waits, on a replica without the adapter in a device slot, for the
adapter's load (``adapter_load_s``: the replica's measured ``lora_load_s``, else the median
the others measured, else ``DEFAULT_LORA_LOAD_S``); the ``prefix`` policy prices it, the
baselines ignore it. Every policy's ``choose`` raises ``ValueError`` on an empty candidate list
or a negative prompt length.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from router.config import RouterConfig
from router.index_types import Match
from router.load import ReplicaLoad
from router.protocol import BlockHash, ReplicaStats

# Seconds to put a LoRA adapter into a device slot, charged while no replica has measured one
# (``ReplicaStats.lora_load_s``). An order of magnitude, not a measurement: a rank-16
# adapter of a 7-8B model's seven projections is tens of MB copied from host memory and
# fused per layer. It only decides while the burst that loads the first adapter is routed;
# from then on the replicas' own measurements are priced.
DEFAULT_LORA_LOAD_S = 0.05


class RoutingReason(str, enum.Enum):
    """Why a replica won; the value is the ``reason`` label of ``router_decisions_total``.

    "load" used to mean three things; it is now ``SHORTEST_QUEUE`` (the price chose, no
    prefix held), ``LOAD_BOUND`` (the bound overruled the price) and ``BASELINE`` (a
    cache-blind baseline chose)."""

    PREFIX = "prefix"
    """The unique cheapest candidate holds the longest cached prefix."""
    SHORTEST_QUEUE = "shortest_queue"
    """The unique cheapest candidate holds nothing of the request: its queue decided."""
    TIE = "tie"
    """Candidates tied on price and match (some replica holds a prefix); tie-breaks decided."""
    COLD = "cold"
    """Candidates tied and no replica holds any prefix: load, recency, then rendezvous."""
    LOAD_BOUND = "load_bound"
    """The load bound excluded a cheaper replica: the bound, not the price, decided."""
    BASELINE = "baseline"
    """A load-only baseline (``round_robin``, ``least_loaded``, ``pow2``) chose."""
    FALLBACK = "fallback"
    """The index was unreachable: the policy chose with no matches (set by ``Router``)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ReplicaView:
    """One routing candidate: its last reported stats (rates, liveness, KV format) and its
    load now (``router.load.replica_load``: the stats merged with the routers' requests)."""

    replica_id: str
    stats: ReplicaStats
    load: ReplicaLoad


@dataclass(frozen=True)
class Decision:
    replica_id: str
    predicted_ttft_s: float
    matched_blocks: int
    """Leading blocks of the request the chosen replica holds (device + host tiers)."""
    reason: RoutingReason
    """Why this replica won."""
    pull_from: str | None = None
    """The peer the chosen replica pulls the request's leading blocks from before admitting it:
    set when the choice was priced with a pull (``kv_pull_tokens_per_s``) because
    that peer holds more leading device blocks than the chosen replica holds in either tier."""
    pull_blocks: int = 0
    """Leading blocks to pull from ``pull_from`` (what it holds on its device, at most the
    request's blocks); 0 without a pull."""


class RoutingPolicy(Protocol):
    name: str

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        replicas: Sequence[ReplicaView],
        matches: Mapping[str, Match],
        *,
        lora_name: str | None = None,
    ) -> Decision:
        """The replica for a request of ``num_prompt_tokens`` tokens hashed into
        ``block_hashes`` (in its adapter's namespace), given what ``matches`` says each
        replica holds; ``lora_name``: the request's LoRA adapter (None: the base model)."""
        ...


def rendezvous_weight(key: bytes, replica_id: str) -> int:
    """Highest-random-weight score of ``replica_id`` for ``key``; same on every router."""
    return xxhash.xxh3_64_intdigest(key + b"\0" + replica_id.encode())


def rendezvous_pick(key: bytes, replica_ids: Sequence[str]) -> str:
    return max(replica_ids, key=lambda rid: (rendezvous_weight(key, rid), rid))


class TTFTModel:
    """Predicted time to first token of a request on one replica, from its stats."""

    def __init__(self, config: RouterConfig) -> None:
        self.block_size = config.block_size
        self.default_prefill_tokens_per_s = config.default_prefill_tokens_per_s
        self.default_decode_step_s = config.default_decode_step_s
        self.default_host_to_device_tokens_per_s = config.default_host_to_device_tokens_per_s
        self.kv_pull_tokens_per_s = config.kv_pull_tokens_per_s

    def prefill_tokens_per_s(self, stats: ReplicaStats) -> float:
        return stats.prefill_tokens_per_s or self.default_prefill_tokens_per_s

    def decode_step_s(self, view: ReplicaView) -> float:
        """One decode step of the replica's running batch now, at the decode rate it
        reported."""
        num_running = view.load.num_running
        if view.stats.decode_tokens_per_s > 0 and num_running > 0:
            return num_running / view.stats.decode_tokens_per_s
        return self.default_decode_step_s

    def queue_s(self, view: ReplicaView) -> float:
        """Wait before this replica starts a new prefill: the prompt tokens queued ahead, plus
        one decode step per queued request (chunked prefill shares each step with the running
        decodes)."""
        load = view.load
        return load.queued_prefill_tokens / self.prefill_tokens_per_s(
            view.stats
        ) + load.num_queued * self.decode_step_s(view)

    def kv_wait_s(self, view: ReplicaView, num_prompt_blocks: int) -> float:
        """Wait before the replica has KV space for ``num_prompt_blocks`` more blocks: 0 while
        they fit in its free blocks (those no running request holds, less what the prompts
        queued ahead take), else until enough running requests finish. Those finish
        ``decode_s`` after their first token, so with the residual times spread evenly the
        k-th of n ends about ``k / (n + 1)`` of it from now, each freeing the blocks a running
        request holds on average. The blocks the running requests will still grow by are not
        counted: the engine admits a prompt into blocks they may later need (and preempts
        then), and counting them sent a workload's repeats away from their prefix's holders
        to prefill it again. 0 for a replica that does not report its blocks or has no
        ``decode_s`` yet."""
        stats = view.stats
        num_running = stats.num_running
        if stats.num_kv_blocks <= 0 or stats.decode_s <= 0 or num_running <= 0:
            return 0.0
        held_blocks = stats.kv_usage * stats.num_kv_blocks
        queued_blocks = view.load.queued_prefill_tokens / self.block_size
        deficit_blocks = num_prompt_blocks - (stats.num_kv_blocks - held_blocks - queued_blocks)
        if deficit_blocks <= 0 or held_blocks <= 0:
            return 0.0
        num_finishes = min(math.ceil(deficit_blocks * num_running / held_blocks), num_running)
        return stats.decode_s * num_finishes / (num_running + 1)

    def predicted_ttft_s(
        self,
        view: ReplicaView,
        match: Match | None,
        num_prompt_tokens: int,
        miss_cost_factor: float = 1.0,
        peer_blocks: int = 0,
    ) -> float:
        """``miss_cost_factor`` > 1 also charges the prefill a miss adds to that replica's queue
        (the delay it imposes on the requests behind it); 1 is the request's own TTFT. The
        request's own prefill shares a step with the running decodes when there are any.
        ``peer_blocks``: leading blocks another replica holds on its device; with pulls on, the
        part of them past this replica's match is priced as a pull (no ``miss_cost_factor``: a
        pull does not occupy the prefill queue), not as a prefill."""
        stats = view.stats
        num_device_tokens = num_host_tokens = 0
        if match is not None:
            num_device_tokens = min(match.device_blocks * self.block_size, num_prompt_tokens)
            num_host_tokens = min(
                match.host_blocks * self.block_size, num_prompt_tokens - num_device_tokens
            )
        num_miss_tokens = num_prompt_tokens - num_device_tokens - num_host_tokens
        pull_s = 0.0
        if self.kv_pull_tokens_per_s is not None and peer_blocks > 0:
            num_local_tokens = num_device_tokens + num_host_tokens
            num_remote_tokens = max(
                0, min(peer_blocks * self.block_size, num_prompt_tokens) - num_local_tokens
            )
            num_miss_tokens -= num_remote_tokens
            pull_s = num_remote_tokens / self.kv_pull_tokens_per_s
        host_rate = stats.host_to_device_tokens_per_s or self.default_host_to_device_tokens_per_s
        busy = view.load.num_requests > 0
        num_prompt_blocks = -(-(num_prompt_tokens - num_device_tokens) // self.block_size)
        return (
            self.queue_s(view)
            + self.kv_wait_s(view, num_prompt_blocks)
            + miss_cost_factor * num_miss_tokens / self.prefill_tokens_per_s(stats)
            + num_host_tokens / host_rate
            + pull_s
            + (self.decode_step_s(view) if busy else 0.0)
        )


def load_rank(view: ReplicaView) -> tuple[int, int]:
    """How loaded a replica is where a policy chooses by load, lightest first: the prefill
    tokens queued there (what a new request's first token waits behind), then its requests
    (a running one only lengthens each step a little). By request count alone, a closed loop
    of equal requests locks into cohorts: the requests that finish together on one replica
    leave it the fewest, their successors all go there, prefill in one step and finish
    together again, each paying the whole cohort's prefill."""
    return view.load.queued_prefill_tokens, view.load.num_requests


def check_request(replicas: Sequence[ReplicaView], num_prompt_tokens: int) -> None:
    """Raise ``ValueError`` on an empty candidate list or a negative prompt length."""
    if not replicas:
        raise ValueError("replicas must hold at least one candidate")
    if num_prompt_tokens < 0:
        raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")


def num_matched(matches: Mapping[str, Match], replica_id: str) -> int:
    """Leading blocks ``replica_id`` holds (device + host), 0 when it holds none."""
    match = matches.get(replica_id)
    return 0 if match is None else match.num_blocks


def peer_device_blocks(matches: Mapping[str, Match]) -> dict[str, int]:
    """Replica id -> the most leading device blocks any *other* replica in ``matches`` holds
    (what a pull could bring it); only replicas in ``matches`` and ``""`` (every other replica)
    are keys."""
    top_id, top, second = "", 0, 0
    for replica_id, match in matches.items():
        if match.device_blocks > top:
            top_id, top, second = replica_id, match.device_blocks, top
        elif match.device_blocks > second:
            second = match.device_blocks
    result = {replica_id: top for replica_id in matches}
    result[""] = top
    if top_id:
        result[top_id] = second
    return result


def pull_source(matches: Mapping[str, Match], replica_id: str) -> tuple[str, int] | None:
    """The other replica holding the most leading device blocks (ties: the smaller id, the
    same on every router) and that count, when it holds more than ``replica_id`` holds in
    either tier: where ``replica_id`` pulls from. None when no peer holds more."""
    best: tuple[str, int] | None = None
    for peer_id, match in sorted(matches.items()):
        if peer_id != replica_id and match.device_blocks > (0 if best is None else best[1]):
            best = (peer_id, match.device_blocks)
    if best is None or best[1] <= num_matched(matches, replica_id):
        return None
    return best


def adapter_load_s(replicas: Sequence[ReplicaView], lora_name: str | None) -> dict[str, float]:
    """Replica id -> seconds a request on adapter ``lora_name`` waits for the adapter to be
    put into one of that replica's device slots: 0 where ``lora_adapters`` lists it (and for
    every replica when ``lora_name`` is None, the base model), else the replica's measured
    ``lora_load_s``; a replica that has measured none is charged the median of the others'
    measurements (one deployment loads adapters from the same host memory onto the same kind
    of device), or ``DEFAULT_LORA_LOAD_S`` when none has measured one."""
    if lora_name is None:
        return dict.fromkeys((v.replica_id for v in replicas), 0.0)
    measured = [v.stats.lora_load_s for v in replicas if v.stats.lora_load_s > 0]
    fallback_s = statistics.median(measured) if measured else DEFAULT_LORA_LOAD_S
    return {
        v.replica_id: 0.0
        if lora_name in v.stats.lora_adapters
        else (v.stats.lora_load_s if v.stats.lora_load_s > 0 else fallback_s)
        for v in replicas
    }


def pooled_prefill_rate(views: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The views with one prefill rate for the replicas that measured one: the median.

    One deployment's replicas run one engine configuration on one kind of hardware; what
    their measured prefill rates differ by is the load and contention while they measured
    (on a shared CPU a busy replica measured 190 tokens/s, an idle one 80). Priced per
    replica, a replica that measured slow looked dear for every cold prompt, got none and
    never measured again (a 3-replica run sent 40, 20 and 4 of 64 requests). A replica that
    has measured nothing keeps 0, the model's configured default: it is idle, so it gets
    requests and measures."""
    rates = [v.stats.prefill_tokens_per_s for v in views if v.stats.prefill_tokens_per_s > 0]
    if not rates:
        return list(views)
    rate = statistics.median(rates)
    return [
        ReplicaView(v.replica_id, v.stats.with_prefill_rate(rate), v.load)
        if 0 < v.stats.prefill_tokens_per_s != rate
        else v
        for v in views
    ]
