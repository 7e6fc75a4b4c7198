"""The routing simulator's state: the run's configuration (``SimConfig``), one replica's
queue, block pool and running requests (``SimReplica``, its admitted prefills ``Prefill`` and
decodes ``Decoding``), each request's record (``RequestRecord``) and a run's figures
(``SimResult``). ``bench.sim.simulator`` owns how they change; this module only holds them.
Failure modes: a ``SimConfig`` with a non-positive size, a negative host tier or an unknown
prefill order raises ``ValueError``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from bench.sim.cache import BlockPool
from bench.sim.calibration import DEFAULT_RATES, EngineRates, PullRates
from bench.sim.workloads import Request
from worker.config import PREFILL_ORDERS, EngineConfig
from worker.metrics import EngineMetrics


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int
    capacity_blocks: int
    block_size: int = 16
    host_capacity_blocks: int = 0
    """Per-replica host tier (0: none); device evictions land there."""
    rates: EngineRates = DEFAULT_RATES
    seed: int = 0
    pull: PullRates | None = None
    """KV pulls from peer replicas at this rate; None: no pulls (each replica computes its own)."""
    prefill_order: str = EngineConfig.prefill_order
    """Which queued request a replica prefills next: the engine's ``prefill_order``."""

    def __post_init__(self) -> None:
        for name in ("num_replicas", "capacity_blocks", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SimConfig.{name} must be positive")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"SimConfig.prefill_order must be one of {', '.join(PREFILL_ORDERS)}")
        if self.host_capacity_blocks < 0:
            raise ValueError("SimConfig.host_capacity_blocks must be >= 0")


@dataclass
class SimReplica:
    index: int
    replica_id: str
    cache: BlockPool
    queue: deque = field(default_factory=deque)
    prefill: Prefill | None = None
    """The prefill whose chunk is under way, None while the server is idle."""
    paused: list = field(default_factory=list)
    """Admitted prefills waiting for their next chunk (overtaken at a step boundary), holding
    their blocks; empty while the server is idle."""
    num_running: int = 0
    num_inflight: int = 0
    num_queued_prefill_tokens: int = 0
    queued_tokens_by_request: dict = field(default_factory=dict)
    num_served: int = 0
    in_flight: set = field(default_factory=set)
    """Blocks being pulled into this replica or computed by its admitted prefills (dedup)."""
    pull_queue: deque = field(default_factory=deque)
    """(request, first block, end block) pulls waiting for or using the transfer link."""
    pulling: bool = False
    num_pulls: dict = field(default_factory=dict)
    """request id -> pulls it made (bounded by ``_MAX_PULLS_PER_REQUEST``)."""
    pull_pins: dict = field(default_factory=dict)
    """request id -> blocks its finished pull pinned, released when its prefill starts."""
    prefill_skips: dict = field(default_factory=dict)
    """request id -> prefill starts of younger requests that overtook it (shortest_first)."""
    waiting_for_kv: bool = False
    """A queued request's first chunk, or a paused prefill's next, did not fit in the pool: it
    waits at the head of the queue until blocks are freed."""
    decoding: dict = field(default_factory=dict)
    """request id -> its ``Decoding``, in admission order (the newest last: the victim)."""
    first_cached_tokens: dict = field(default_factory=dict)
    """request id -> cached tokens at its first admission (what it reports, as the engine's
    ``num_cached_tokens``), kept until its prefill ends."""
    generated_before: dict = field(default_factory=dict)
    """request id -> output tokens a preempted request had generated (recomputed when it is
    admitted again)."""
    growth_timer: int = 0
    """Bumped when the next growth check is rescheduled: only the latest one counts."""
    prefill_step_s: float = 0.0
    """Length of the step of the chunk under way: its tokens and one decode of each running
    request."""
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    """What the engine measures and reports of it: here the decode time of finished requests."""
    version: int = 0
    """Bumped on every state change, so adapters can cache what they derive from the state."""

    @property
    def prefilling(self) -> bool:
        return self.prefill is not None

    @property
    def num_prefills(self) -> int:
        """Admitted requests still prefilling (the engine counts them as running)."""
        return len(self.paused) + (1 if self.prefill is not None else 0)


@dataclass(eq=False)
class Prefill:
    """A request's prefill on a replica, computed a chunk of at most ``max_num_batched_tokens``
    per step. It holds its device hit (pinned), a slot for every host hit and slots for the
    chunks computed so far and the one under way, as the engine's scheduler allocates them."""

    request: Request
    seq: int
    """Admission order on the simulator (the newest admitted is preempted first)."""
    num_device_blocks: int
    """Prompt blocks found on the device at admission (pinned)."""
    num_host_blocks: int
    """Prompt blocks brought back from the host tier at admission (a slot each)."""
    num_tokens: int
    """Tokens to compute: the uncached prompt, plus a preempted request's output so far."""
    num_final_slots: int
    """Slots held at the end: every prompt block past the device hit, plus the blocks a
    preempted request's recomputed output fills."""
    num_computed: int = 0
    """Tokens of the finished chunks."""
    num_slots: int = 0
    """Slots reserved so far."""
    chunk_tokens: int = 0
    """Tokens of the chunk under way."""
    timer: int = 0
    """Bumped when a chunk starts: only the latest chunk's end event counts."""


@dataclass(eq=False)
class Decoding:
    """One request decoding on a replica: ``tokens`` generated by ``at_s``, one more every
    ``interval_s`` from then (the replica's step, retimed whenever it changes);
    ``num_output_blocks`` are the blocks its generated tokens hold in the pool so far."""

    request: Request
    seq: int
    """Its prefill's admission order (the newest admitted is preempted first)."""
    tokens: float
    at_s: float
    interval_s: float
    num_output_blocks: int = 0
    timer: int = 0
    """Bumped when its end is rescheduled: only the latest end event counts."""


@dataclass
class RequestRecord:
    replica: int
    num_cached_tokens: int = 0
    num_pulled_tokens: int = 0
    ttft_s: float | None = None
    finish_s: float | None = None


@dataclass(frozen=True)
class SimResult:
    workload: str
    policy: str
    replicas: int
    num_requests: int
    hit_rate: float
    oracle_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    throughput_tok_s: float
    output_throughput_tok_s: float
    max_mean_load: float
    sim_wall_s: float
    pulled_token_rate: float = 0.0
    """Prompt tokens pulled from peers / all prompt tokens (part of ``hit_rate``)."""
    num_dedup_deferrals: int = 0
    """Times a prefill start passed over a request whose next block was in flight."""
    num_kv_waits: int = 0
    """Times a replica's next prefill (a queued request, or a prefill that preempted itself)
    waited for KV blocks to be freed."""
    num_preemptions: int = 0
    """Running requests (decoding or prefilling) preempted by recompute because their
    replica's pool was full."""
    pooled_hit_rate: float = 0.0
    """Hit rate of one LRU cache as large as all the replicas' device (and host) caches
    together, seeing every request at its arrival: the oracle with the cluster's capacity.
    Where it is below ``oracle_hit_rate`` the workload does not fit; what lies between it and
    ``hit_rate`` is what splitting the capacity over replicas (and copies) costs."""
    copied_block_share: float = 0.0
    """Mean, over arrivals, of the share of the device blocks stored cluster-wide that are
    copies (a block held by k replicas counts k - 1 times): the capacity copies take from
    distinct prefixes, the part of the gap to ``pooled_hit_rate`` that routing decides."""
