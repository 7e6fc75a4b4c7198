"""The discrete-event routing simulator: replicas with LRU block caches, queues and costs.

Model of one replica (documented simplifications, shared by every policy alike):
- Prefill is one FCFS server. A request's prefill starts when the previous one ends; its cache
  hit is looked up *then* (so a request queued behind a same-prefix request hits). Its service
  time is ``uncached / prefill_rate + host / host_to_device_rate`` plus, per chunk of
  ``max_num_batched_tokens``, one decode step of the requests already running (chunked prefill
  shares each step with decodes). At least one token is always computed (the last prompt token).
- KV lives in a ``BlockPool`` per replica (vLLM's model): a request pins its hit blocks and
  reserves slots for the rest when its prefill starts; the computed blocks become stored (the
  ``stored`` KV event) when its prefill ends; generated tokens reserve blocks while it decodes;
  at the end everything is unpinned and stays cached until evicted (LRU). TTFT is the end of
  its prefill minus its arrival.
- Decode then takes ``(output_tokens - 1)`` steps priced at the running batch size at entry.
  The running batch is not capped (``max_num_seqs`` is not modelled, nor preemption).
- The router-side count ``num_inflight`` goes up when a request is routed and down when it
  finishes, as every real router's in-flight counter does.

Policies see the simulator through ``SimView`` methods: exact per-replica matches (what KV
events report), per-replica state, the rates, a seeded RNG. Failure modes: invalid sizes raise
``ValueError``; a policy returning an out-of-range replica raises ``ValueError`` naming it.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.sim.cache import BlockId, BlockPool, OracleCache
from bench.sim.calibration import DEFAULT_RATES, EngineRates
from bench.sim.workloads import Request, Workload


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int
    capacity_blocks: int
    block_size: int = 16
    host_capacity_blocks: int = 0
    """Per-replica host tier (0: none); device evictions land there (issue 10)."""
    rates: EngineRates = DEFAULT_RATES
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_replicas", "capacity_blocks", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SimConfig.{name} must be positive")
        if self.host_capacity_blocks < 0:
            raise ValueError("SimConfig.host_capacity_blocks must be >= 0")


@dataclass
class SimReplica:
    index: int
    replica_id: str
    cache: BlockPool
    queue: deque = field(default_factory=deque)
    prefilling: bool = False
    num_running: int = 0
    num_inflight: int = 0
    num_queued_prefill_tokens: int = 0
    queued_tokens_by_request: dict = field(default_factory=dict)
    num_served: int = 0
    version: int = 0
    """Bumped on every state change, so adapters can cache what they derive from the state."""


@dataclass
class RequestRecord:
    replica: int
    num_cached_tokens: int = 0
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


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


_ARRIVAL, _PREFILL_DONE, _DECODE_DONE = 0, 1, 2


class Simulator:
    """Runs one workload through one policy on ``config.num_replicas`` replicas."""

    def __init__(self, config: SimConfig, policy) -> None:
        self.config = config
        self.policy = policy
        self.rates = config.rates
        self.rng = random.Random(config.seed)
        self.now_s = 0.0
        self.holders: dict[BlockId, set[int]] = {}
        """Device-tier index: block -> replicas holding it (exactly what KV events report)."""
        self.host_holders: dict[BlockId, set[int]] = {}
        self.replicas = [self._make_replica(i) for i in range(config.num_replicas)]
        self._events: list = []
        self._seq = 0

    def _make_replica(self, i: int) -> SimReplica:
        device, host = self.holders, self.host_holders

        def on_change(block: BlockId, tier: str, stored: bool) -> None:
            index = device if tier == "device" else host
            if stored:
                owners = index.get(block)
                if owners is None:
                    index[block] = {i}
                else:
                    owners.add(i)
                return
            owners = index.get(block)
            if owners is not None:
                owners.discard(i)
                if not owners:
                    del index[block]

        cache = BlockPool(self.config.capacity_blocks, self.config.host_capacity_blocks, on_change)
        return SimReplica(i, f"replica-{i}", cache)

    # ---- what policies may read -------------------------------------------------------------
    def exact_matches(self, blocks: Sequence[BlockId]) -> dict[int, tuple[int, int]]:
        """Replica index -> (device blocks, host blocks) matched, for replicas matching any."""
        if not blocks:
            return {}
        if self.config.host_capacity_blocks:
            owners = self.holders.get(blocks[0], set()) | self.host_holders.get(blocks[0], set())
            return {i: self.replicas[i].cache.match(blocks) for i in owners}
        return self._device_matches(blocks)

    def _device_matches(self, blocks: Sequence[BlockId]) -> dict[int, tuple[int, int]]:
        """Device-only matches by bisection over holder-set sizes.

        Pools are prefix-closed (see ``cache``), so ``holders(b[i+1]) <= holders(b[i])``: the
        sizes never grow along the chain and equal sizes mean equal sets. Only the positions
        where the size drops need a set difference, found in O(changes * log n) lookups.
        """
        empty: set = set()
        holders = [None] * len(blocks)

        def at(i: int) -> set:
            if holders[i] is None:
                holders[i] = self.holders.get(blocks[i], empty)
            return holders[i]

        result: dict[int, tuple[int, int]] = {}
        stack = [(0, len(blocks) - 1)]
        while stack:
            lo, hi = stack.pop()
            if len(at(lo)) == len(at(hi)):
                continue
            if hi - lo == 1:
                for i in at(lo) - at(hi):
                    result[i] = (lo + 1, 0)
                continue
            mid = (lo + hi) // 2
            stack.append((lo, mid))
            stack.append((mid, hi))
        for i in at(len(blocks) - 1):
            result[i] = (len(blocks), 0)
        return result

    @staticmethod
    def num_waiting(replica: SimReplica) -> int:
        """Requests queued behind the one being prefilled."""
        return len(replica.queue) - (1 if replica.prefilling else 0)

    def kv_usage(self, replica: SimReplica) -> float:
        return min(1.0, replica.cache.num_busy_blocks / self.config.capacity_blocks)

    # ---- the event loop ---------------------------------------------------------------------
    def _push(self, at_s: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at_s, self._seq, kind, payload))

    def run(self, workload: Workload, progress: Callable[[int], None] | None = None) -> SimResult:
        started = time.perf_counter()
        requests = workload.requests
        if not requests:
            raise ValueError(f"workload {workload.name!r} has no requests")
        records: list[RequestRecord | None] = [None] * len(requests)
        oracle = OracleCache()
        oracle_hit_tokens = 0
        next_arrival = 0
        while next_arrival < len(requests) or self._events:
            if next_arrival < len(requests) and (
                not self._events or requests[next_arrival].arrival_s <= self._events[0][0]
            ):
                req = requests[next_arrival]
                next_arrival += 1
                self.now_s = req.arrival_s
                oracle_hit_tokens += self._cached_tokens(req, oracle.hit_blocks(req.block_ids))
                records[req.request_id] = self._route(req)
                if progress is not None:
                    progress(1)
                continue
            at_s, _, kind, payload = heapq.heappop(self._events)
            self.now_s = at_s
            if kind == _PREFILL_DONE:
                self._finish_prefill(payload, records)
            else:
                replica, req = payload
                self._finish_decode(replica, req, records)
        return self._summarize(workload, records, oracle_hit_tokens, time.perf_counter() - started)

    def _route(self, req: Request) -> RequestRecord:
        chosen = self.policy.choose(self, req)
        if not 0 <= chosen < len(self.replicas):
            raise ValueError(f"policy {self.policy.name!r} chose replica {chosen} out of range")
        replica = self.replicas[chosen]
        replica.num_inflight += 1
        device, host = replica.cache.match(req.block_ids)
        num_queued = req.num_prompt_tokens - self._cached_tokens(req, device + host)
        replica.queued_tokens_by_request[req.request_id] = num_queued
        replica.num_queued_prefill_tokens += num_queued
        replica.queue.append(req)
        replica.version += 1
        if not replica.prefilling:
            self._start_prefill(replica)
        return RequestRecord(chosen)

    def _cached_tokens(self, req: Request, num_blocks: int) -> int:
        # the last prompt token is always computed (its logits give the first output token)
        return min(num_blocks * self.config.block_size, req.num_prompt_tokens - 1)

    def _num_output_blocks(self, req: Request) -> int:
        return math.ceil(req.num_output_tokens / self.config.block_size)

    def _start_prefill(self, replica: SimReplica) -> None:
        req = replica.queue[0]
        device, host = replica.cache.begin(req.block_ids)
        device_tokens = self._cached_tokens(req, device)
        host_tokens = self._cached_tokens(req, device + host) - device_tokens
        uncached = req.num_prompt_tokens - device_tokens - host_tokens
        num_chunks = math.ceil(uncached / self.rates.max_num_batched_tokens)
        decode_share_s = (
            self.rates.decode_step_s(replica.num_running) if replica.num_running else 0.0
        )
        service_s = (
            uncached / self.rates.prefill_tokens_per_s
            + host_tokens / self.rates.host_to_device_tokens_per_s
            + num_chunks * decode_share_s
        )
        replica.prefilling = True
        replica.version += 1
        payload = (replica, device, device_tokens + host_tokens)
        self._push(self.now_s + service_s, _PREFILL_DONE, payload)

    def _finish_prefill(self, payload, records) -> None:
        replica, num_hit_blocks, num_cached_tokens = payload
        req = replica.queue.popleft()
        record = records[req.request_id]
        record.num_cached_tokens = num_cached_tokens
        record.ttft_s = self.now_s - req.arrival_s
        replica.cache.commit(req.block_ids, num_hit_blocks)
        replica.cache.reserve(self._num_output_blocks(req))
        replica.num_queued_prefill_tokens -= replica.queued_tokens_by_request.pop(req.request_id)
        replica.num_running += 1
        replica.prefilling = False
        replica.version += 1
        decode_s = (req.num_output_tokens - 1) * self.rates.decode_step_s(replica.num_running)
        self._push(self.now_s + decode_s, _DECODE_DONE, (replica, req))
        if replica.queue:
            self._start_prefill(replica)

    def _finish_decode(self, replica: SimReplica, req: Request, records) -> None:
        replica.num_running -= 1
        replica.num_inflight -= 1
        replica.num_served += 1
        replica.cache.unreserve(self._num_output_blocks(req))
        replica.cache.release(req.block_ids)
        replica.version += 1
        records[req.request_id].finish_s = self.now_s
        done = getattr(self.policy, "on_finished", None)
        if done is not None:
            done(self, req, replica.index)

    def _summarize(self, workload: Workload, records, oracle_hit_tokens: int, wall_s: float):
        requests = workload.requests
        prompt_tokens = sum(r.num_prompt_tokens for r in requests)
        output_tokens = sum(r.num_output_tokens for r in requests)
        ttfts = [rec.ttft_s for rec in records]
        span_s = max(rec.finish_s for rec in records) - requests[0].arrival_s
        loads = [r.num_served for r in self.replicas]
        return SimResult(
            workload=workload.name,
            policy=self.policy.name,
            replicas=len(self.replicas),
            num_requests=len(requests),
            hit_rate=sum(rec.num_cached_tokens for rec in records) / prompt_tokens,
            oracle_hit_rate=oracle_hit_tokens / prompt_tokens,
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p90_s=percentile(ttfts, 90),
            ttft_p99_s=percentile(ttfts, 99),
            ttft_mean_s=sum(ttfts) / len(ttfts),
            throughput_tok_s=(prompt_tokens + output_tokens) / span_s,
            output_throughput_tok_s=output_tokens / span_s,
            max_mean_load=max(loads) / (sum(loads) / len(loads)),
            sim_wall_s=wall_s,
        )
