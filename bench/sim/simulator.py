"""The discrete-event routing simulator: replicas with LRU block caches, queues and costs.

Model of one replica (documented simplifications, shared by every policy alike):
- Prefill runs a chunk of at most ``max_num_batched_tokens`` per engine step, one request's
  chunk per step (the engine can fill a step's budget from several prompts). A request's
  cache hit is looked up when it is admitted (so a request queued behind a same-prefix
  request hits). A chunk that finds the server idle while requests decode first waits for the
  decode step under way to end, as the engine admits work only between steps: a uniform share
  of that step (drawn from an RNG of its own, seeded from ``SimConfig.seed``, so the
  policies' draws do not move). At every step boundary the next chunk goes, as the engine's
  scheduler decides, to the first of the admitted prefills and the queued requests in
  ``SimConfig.prefill_order``: the fewest tokens left first (``shortest_first``, with the
  engine's starvation bound ``MAX_PREFILL_SKIPS``, a skip counted per step), so a mostly
  cached prompt overtakes a cold one between two of its chunks (the overtaken prefill keeps
  its blocks, ``SimReplica.paused``); or admitted ones first, then arrival order (``fcfs``).
  A chunk's step takes ``tokens / prefill_rate`` plus one decode step of the requests already
  decoding, and the first chunk also ``host / host_to_device_rate`` for its host hits. At
  least one token is always computed (the last prompt token).
- Decode: after its prefill a request generates one token per step of its replica. A step
  is a decode-only step priced at the running batch size, ``decode_step_s(num_running)``,
  or, while a chunk runs, that chunk's step, which slows the decodes. Every decode's end is
  rescheduled whenever its replica's step length changes (a chunk starts or ends, a decode
  joins or leaves). The running batch is capped by KV only (``max_num_seqs`` is not
  modelled).
- KV admission and preemption (the engine's rules, ``worker/scheduler.py``): a request is
  admitted when its first chunk's blocks fit in its replica's pool (``BlockPool.fits``: its
  hit pinned, a slot for each host hit and for each block the chunk fills, evicting only
  cached blocks); otherwise it waits at the head of the queue and no request behind it is
  admitted until a decode ends or a preemption frees blocks. Each later chunk takes the
  blocks it fills when it starts. A decoding request needs one more block every
  ``block_size`` generated tokens; decodes take the blocks they have grown into at every
  step boundary and event on the replica (evicting cached ones), and at the moment their
  growth would need more blocks than the pool has free (a growth check scheduled for it,
  between chunks only: a chunk's step ends first). Where the pool has none left, the newest
  admitted running request is preempted by recompute: a prefill, which then keeps the
  prompt blocks its finished chunks computed in the prefix cache, or a decoding request,
  whose blocks are freed (its prompt's stay cached) and which, admitted again, computes its
  prompt's uncached part and the tokens it had generated before decoding the rest. A
  prefill whose next chunk's blocks are short preempts the newest admitted prefill, itself
  unless one was admitted after it (the decodes hold theirs already). Either goes back to
  the head of the queue. A request's TTFT and cached tokens are those of its first
  admission and prefill, as the engine's are. A request larger than an empty pool still
  runs and overflows (``BlockPool.num_overflow_blocks``).
- In-flight prefix dedup (worker/scheduler.py ``_admit``'s rule): when the prefill server
  picks its next request, one whose next uncached prompt block is in flight on that replica
  (being pulled in, or computed by an admitted prefill) is passed over, not admitted: the
  requests behind it go ahead, and it is admitted once the block has landed (then it hits).
  A prefill's uncomputed blocks are in flight from its admission to its end or preemption.
- KV pulls (``SimConfig.pull``; None: off, the old model): a request routed to a replica that
  lacks part of its prefix which another replica holds on its device (the exact index, i.e. a
  live peer) pulls those blocks first, on a per-replica FCFS transfer link separate from the
  prefill server, taking ``PullRates.pull_s(tokens)``; the pulled blocks are then stored on the
  replica (pinned until its prefill starts) and count as cached tokens, as a KV connector's do
  in vLLM. No pull starts for blocks already in flight on that replica (dedup: it waits). The
  peer's copy is not pinned during the transfer (not modelled). With pulls, dedup reaches
  across replicas: a request whose next block a peer's prefill is computing right now waits
  for it (passed over like a local one) and then pulls it, rather than computing a copy; it
  cannot wait longer than computing the block itself would take, since that prefill started
  first. Whether a request is pulled is decided again when the prefill server reaches it.
- The router-side count ``num_inflight`` goes up when a request is routed and down when it
  finishes, as every real router's in-flight counter does.

Policies see the simulator through ``SimView`` methods: exact per-replica matches (what KV
events report), per-replica state, the rates, a seeded RNG. Failure modes: invalid sizes raise
``ValueError``; a policy returning an out-of-range replica raises ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time
from collections.abc import Callable, Sequence

from bench.common import percentile
from bench.sim.cache import BlockId, BlockPool, LRUBlockCache, OracleCache
from bench.sim.state import (
    Decoding,
    Prefill,
    RequestRecord,
    SimConfig,
    SimReplica,
    SimResult,
)
from bench.sim.workloads import Request, Workload
from worker.scheduler import MAX_PREFILL_SKIPS

_ARRIVAL, _CHUNK_DONE, _DECODE_DONE, _PULL_DONE, _GROWTH = 0, 1, 2, 3, 4
_MAX_PULLS_PER_REQUEST = 2


class Simulator:
    """Runs one workload through one policy on ``config.num_replicas`` replicas."""

    def __init__(self, config: SimConfig, policy) -> None:
        self.config = config
        self.policy = policy
        self.rates = config.rates
        self.rng = random.Random(config.seed)
        self._step_phase = random.Random(config.seed + 1)
        """Where in the decode step under way an idle replica's next prefill arrives."""
        self.now_s = 0.0
        self.holders: dict[BlockId, set[int]] = {}
        """Device-tier index: block -> replicas holding it (exactly what KV events report)."""
        self.host_holders: dict[BlockId, set[int]] = {}
        self.num_device_blocks = 0
        """Device blocks stored over all replicas (a block on k replicas counts k times)."""
        self.replicas = [self._make_replica(i) for i in range(config.num_replicas)]
        self._events: list = []
        self._seq = 0
        self.num_dedup_deferrals = 0
        self.num_kv_waits = 0
        self.num_preemptions = 0
        self.computing: dict[BlockId, int] = {}
        """Blocks some replica's prefill is computing now -> how many (pulls on only)."""
        self.waiters: dict[BlockId, set[int]] = {}
        """Block being computed -> replicas with a request waiting for it (pulls on only)."""
        self._fcfs = config.prefill_order == "fcfs"
        self._num_admitted = 0

    def _make_replica(self, i: int) -> SimReplica:
        device, host = self.holders, self.host_holders

        def on_change(block: BlockId, tier: str, stored: bool) -> None:
            index = device if tier == "device" else host
            if tier == "device":
                self.num_device_blocks += 1 if stored else -1
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
        """Requests not admitted yet, pulling ones included."""
        return len(replica.queue) + len(replica.pull_queue)

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
        config = self.config
        pooled = LRUBlockCache(
            config.num_replicas * (config.capacity_blocks + config.host_capacity_blocks)
        )
        pooled_hit_tokens = 0
        copied_share_sum = 0.0
        next_arrival = 0
        while next_arrival < len(requests) or self._events:
            if next_arrival < len(requests) and (
                not self._events or requests[next_arrival].arrival_s <= self._events[0][0]
            ):
                req = requests[next_arrival]
                next_arrival += 1
                self.now_s = req.arrival_s
                oracle_hit_tokens += self._cached_tokens(req, oracle.hit_blocks(req.block_ids))
                pooled_hit_tokens += self._cached_tokens(req, pooled.match(req.block_ids))
                pooled.touch_request(req.block_ids)
                if self.num_device_blocks:
                    copied_share_sum += 1.0 - len(self.holders) / self.num_device_blocks
                records[req.request_id] = self._route(req)
                if progress is not None:
                    progress(1)
                continue
            at_s, _, kind, payload = heapq.heappop(self._events)
            self.now_s = at_s
            if kind == _CHUNK_DONE:
                replica, prefill, timer = payload
                if replica.prefill is prefill and prefill.timer == timer:
                    self._finish_chunk(replica, prefill, records)
                # else: preempted, a later admission computes it
            elif kind == _PULL_DONE:
                self._finish_pull(payload, records)
            elif kind == _GROWTH:
                replica, timer = payload
                if replica.growth_timer == timer and not replica.prefilling:
                    self._grow_decodes(replica)
                    if replica.queue and not replica.prefilling:  # a preemption's victim
                        self._start_prefill(replica, after_prefill=True)
            else:
                replica, decoding, timer = payload
                if (
                    replica.decoding.get(decoding.request.request_id) is decoding
                    and decoding.timer == timer
                ):
                    self._finish_decode(replica, decoding, records)
                # else: preempted or retimed, a later event ends it
        wall_s = time.perf_counter() - started
        result = self._summarize(workload, records, oracle_hit_tokens, pooled_hit_tokens, wall_s)
        return dataclasses.replace(result, copied_block_share=copied_share_sum / len(requests))

    def _route(self, req: Request) -> RequestRecord:
        chosen = self.policy.choose(self, req)
        if not 0 <= chosen < len(self.replicas):
            raise ValueError(f"policy {self.policy.name!r} chose replica {chosen} out of range")
        replica = self.replicas[chosen]
        replica.num_inflight += 1
        device, host = replica.cache.match(req.block_ids)
        pull_end = self._pull_end(replica, req, device + host)
        num_queued = req.num_prompt_tokens - self._cached_tokens(req, max(device + host, pull_end))
        replica.queued_tokens_by_request[req.request_id] = num_queued
        replica.num_queued_prefill_tokens += num_queued
        replica.version += 1
        if pull_end:
            replica.pull_queue.append((req, pull_end))
            if not replica.pulling:
                self._start_pull(replica)
        else:
            replica.queue.append(req)
            if not replica.prefilling:
                self._start_prefill(replica)
        return RequestRecord(chosen)

    # ---- KV pulls -----------------------------------------------------------------------------
    def _pull_end(self, replica: SimReplica, req: Request, num_held: int) -> int:
        """End block of the pull ``req`` needs on ``replica`` (0: none): the longest device
        prefix a peer holds, when longer than ``num_held`` and its next block is not in flight
        on ``replica`` already (then it waits for that block instead: dedup)."""
        if self.config.pull is None or num_held >= len(req.block_ids):
            return 0
        if req.block_ids[num_held] in replica.in_flight:
            return 0
        best = max(
            (n for i, (n, _) in self._device_matches(req.block_ids).items() if i != replica.index),
            default=0,
        )
        if self._cached_tokens(req, best) <= self._cached_tokens(req, num_held):
            return 0
        return best

    def _start_pull(self, replica: SimReplica) -> None:
        while replica.pull_queue:
            req, end = replica.pull_queue[0]
            blocks = req.block_ids[:end]
            device, host = replica.cache.match(blocks)
            end = min(end, self._pull_end(replica, req, device + host) or device + host)
            if end <= device + host:  # it landed meanwhile, or no peer holds it any more
                replica.pull_queue.popleft()
                replica.queue.append(req)
                if not replica.prefilling:
                    self._start_prefill(replica)
                continue
            blocks = req.block_ids[:end]
            replica.cache.begin(blocks)  # pins the device part, reserves the pulled part
            replica.in_flight.update(blocks[device:])
            num_tokens = self._cached_tokens(req, end) - self._cached_tokens(req, device)
            replica.pulling = True
            replica.num_pulls[req.request_id] = replica.num_pulls.get(req.request_id, 0) + 1
            replica.version += 1
            pull_s = self.config.pull.pull_s(num_tokens)
            self._push(self.now_s + pull_s, _PULL_DONE, (replica, req, device, end, num_tokens))
            return
        replica.pulling = False

    def _finish_pull(self, payload, records) -> None:
        replica, req, device, end, num_tokens = payload
        blocks = req.block_ids[:end]
        replica.cache.commit(blocks, device)
        replica.in_flight.difference_update(blocks[device:])
        previous_end = replica.pull_pins.get(req.request_id, 0)
        if previous_end:  # an earlier pull's pins: this pull's begin pinned those blocks again
            replica.cache.release(req.block_ids[:previous_end])
        replica.pull_pins[req.request_id] = end
        records[req.request_id].num_pulled_tokens += num_tokens
        replica.pull_queue.popleft()
        replica.queue.append(req)
        replica.version += 1
        if not replica.prefilling:
            self._start_prefill(replica)
        self._start_pull(replica)

    def _cached_tokens(self, req: Request, num_blocks: int) -> int:
        # the last prompt token is always computed (its logits give the first output token)
        return min(num_blocks * self.config.block_size, req.num_prompt_tokens - 1)

    def _next_prefill(self, replica: SimReplica) -> Request | None:
        """The first queued request, in the scheduler's order, whose next uncached block is not
        in flight (dedup); None when every queued request waits for one. With pulls, this is
        also where a request is checked again (as vLLM's KV connector is asked at admission):
        one that a peer could now give more blocks than the replica holds goes to the pull link
        instead (at most ``_MAX_PULLS_PER_REQUEST`` times)."""
        if not replica.queue:
            return None
        if not replica.in_flight and self.config.pull is None and self._fcfs:
            return replica.queue[0]
        for req in self._prefill_order(replica):
            device, host = replica.cache.match(req.block_ids)
            num_held = device + host
            if self._cached_tokens(req, num_held) < self._cached_tokens(req, len(req.block_ids)):
                block = req.block_ids[num_held]
                if block in replica.in_flight:
                    self.num_dedup_deferrals += 1
                    continue
                if block in self.computing:  # a peer computes it now: wait, then pull
                    self.num_dedup_deferrals += 1
                    self.waiters.setdefault(block, set()).add(replica.index)
                    continue
            if replica.num_pulls.get(req.request_id, 0) < _MAX_PULLS_PER_REQUEST:
                pull_end = self._pull_end(replica, req, num_held)
                if pull_end:
                    replica.queue.remove(req)
                    replica.pull_queue.append((req, pull_end))
                    if not replica.pulling:
                        self._start_pull(replica)
                    continue
            return req
        return None

    def _starving(self, replica: SimReplica, req: Request) -> bool:
        return replica.prefill_skips.get(req.request_id, 0) >= MAX_PREFILL_SKIPS

    def _prefill_order(self, replica: SimReplica) -> list[Request]:
        """The queue in the order the engine's scheduler would serve it (a copy)."""
        if self._fcfs:
            return list(replica.queue)
        return sorted(replica.queue, key=lambda req: self._priority(replica, req))

    def _tokens_to_admit(self, replica: SimReplica, req: Request) -> int:
        """Tokens a queued request would compute if admitted now: its uncached prompt, and
        the output a preempted one had generated."""
        device, host = replica.cache.match(req.block_ids)
        generated = replica.generated_before.get(req.request_id, 0)
        return req.num_prompt_tokens - self._cached_tokens(req, device + host) + generated

    def _count_skips(self, replica: SimReplica, chosen: Request) -> None:
        """Every queued or paused request older than the one whose chunk starts was overtaken
        once (the engine counts a skip per step)."""
        if self._fcfs:
            return
        skips = replica.prefill_skips
        for req in (*replica.queue, *(p.request for p in replica.paused)):
            if req.request_id < chosen.request_id:
                skips[req.request_id] = skips.get(req.request_id, 0) + 1

    def _start_prefill(self, replica: SimReplica, after_prefill: bool = False) -> None:
        """Starts the next prefill chunk on a replica with none under way: of the admitted
        prefills waiting for their next chunk (``paused``) and the queued request
        ``_next_prefill`` picks, the first in the scheduler's order (``fcfs``: admitted ones
        first, oldest first; ``shortest_first``: fewest tokens left, starving ones first).
        A queued request is admitted only when its first chunk fits; when it does not, no
        request behind it is admitted, but the admitted ones go on. ``after_prefill``: a step
        just ended; else the server was idle and waits out the decode step under way."""
        self._grow_decodes(replica)
        waiting = self._next_prefill(replica)
        candidates: list = sorted(replica.paused, key=lambda p: p.seq)
        if waiting is not None:
            candidates.append(waiting)
        if not self._fcfs:
            candidates.sort(key=lambda item: self._priority(replica, item))
        for item in candidates:
            if isinstance(item, Prefill):
                if item in replica.paused and self._grow_prefill(replica, item):
                    replica.paused.remove(item)
                    replica.prefill = item
                    self._count_skips(replica, item.request)
                    self._run_chunk(replica, item, self._step_wait_s(replica, after_prefill))
                    return
            elif self._admit(replica, item, after_prefill):
                return

    def _priority(self, replica: SimReplica, item) -> tuple[bool, int, int]:
        """Where a paused prefill or a queued request stands in ``shortest_first`` order."""
        if isinstance(item, Prefill):
            req, left = item.request, item.num_tokens - item.num_computed
        else:
            req, left = item, self._tokens_to_admit(replica, item)
        if self._starving(replica, req):
            return (False, 0, req.request_id)  # starving: first, oldest first
        return (True, left, req.request_id)

    def _step_wait_s(self, replica: SimReplica, after_prefill: bool) -> float:
        """How long a chunk that finds the server idle waits for the decode step under way
        to end (a uniform share of it); none at a step boundary."""
        if after_prefill or not replica.num_running:
            return 0.0
        return self._step_phase.random() * self.rates.decode_step_s(replica.num_running)

    def _admit(self, replica: SimReplica, req: Request, after_prefill: bool) -> bool:
        """Admits queued ``req`` and starts its first chunk, if that chunk's blocks fit (its
        device hit pinned, a slot for each host hit and each block the chunk fills); else the
        replica waits for blocks (``waiting_for_kv``) and False. A request alone on its
        replica is admitted even when larger than the pool (it overflows)."""
        generated = replica.generated_before.get(req.request_id, 0)
        device, host = replica.cache.match(req.block_ids)
        device_tokens = self._cached_tokens(req, device)
        num_cached_tokens = self._cached_tokens(req, device + host)
        prefill = Prefill(
            request=req,
            seq=self._num_admitted,
            num_device_blocks=device,
            num_host_blocks=host,
            num_tokens=req.num_prompt_tokens - num_cached_tokens + generated,
            num_final_slots=len(req.block_ids) - device + self._generated_blocks(req, generated),
        )
        first_slots = self._slots_after(prefill, self._next_chunk_tokens(prefill))
        holders = replica.num_running or replica.paused
        if holders and not replica.cache.fits(req.block_ids[:device], first_slots):
            if not replica.waiting_for_kv:
                replica.waiting_for_kv = True
                self.num_kv_waits += 1
            return False  # a step boundary, a decode's end or a preemption tries again
        replica.waiting_for_kv = False
        self._num_admitted += 1
        replica.queue.remove(req)
        replica.cache.begin(req.block_ids[: device + host])  # pins the device hit
        replica.cache.reserve(first_slots - host)
        prefill.num_slots = first_slots
        pinned_end = replica.pull_pins.pop(req.request_id, 0)
        if pinned_end:
            replica.cache.release(req.block_ids[:pinned_end])  # the pull's pins; begin re-pinned
        replica.first_cached_tokens.setdefault(req.request_id, num_cached_tokens)
        replica.in_flight.update(req.block_ids[device + host :])
        if self.config.pull is not None:
            for block in req.block_ids[device + host :]:
                self.computing[block] = self.computing.get(block, 0) + 1
        replica.prefill = prefill
        self._count_skips(replica, req)
        host_s = (num_cached_tokens - device_tokens) / self.rates.host_to_device_tokens_per_s
        self._run_chunk(replica, prefill, self._step_wait_s(replica, after_prefill) + host_s)
        return True

    def _next_chunk_tokens(self, prefill: Prefill) -> int:
        return min(prefill.num_tokens - prefill.num_computed, self.rates.max_num_batched_tokens)

    def _slots_after(self, prefill: Prefill, num_computed: int) -> int:
        """Slots ``prefill`` holds once ``num_computed`` of its tokens are computed: one per
        host hit and per block those tokens reach into, all of them at the end."""
        if num_computed >= prefill.num_tokens:
            return prefill.num_final_slots
        reached = math.ceil(num_computed / self.config.block_size)
        return min(prefill.num_final_slots, prefill.num_host_blocks + reached)

    def _grow_prefill(self, replica: SimReplica, prefill: Prefill) -> bool:
        """Reserves the slots ``prefill``'s next chunk reaches into, preempting the newest
        admitted prefill while they are short (the decodes are the step's already); False
        when that was ``prefill`` itself. Alone on its replica it overflows instead."""
        more = self._slots_after(prefill, prefill.num_computed + self._next_chunk_tokens(prefill))
        more -= prefill.num_slots
        if more <= 0:
            return True
        while not replica.cache.can_reserve(more):
            if not replica.num_running and replica.paused == [prefill]:
                break  # larger than the pool: it overflows
            victim = max(replica.paused, key=lambda p: p.seq)
            self._preempt_prefill(replica, victim)
            if victim is prefill:
                if not replica.waiting_for_kv:  # it waits at the head of the queue
                    replica.waiting_for_kv = True
                    self.num_kv_waits += 1
                return False
        replica.cache.reserve(more)
        prefill.num_slots += more
        return True

    def _run_chunk(self, replica: SimReplica, prefill: Prefill, extra_s: float = 0.0) -> None:
        """Computes ``prefill``'s next chunk in one step that also decodes a token of every
        running request, ending ``extra_s`` later (a wait for the step under way, the first
        chunk's copy of its host hits back)."""
        prefill.chunk_tokens = self._next_chunk_tokens(prefill)
        step_s = prefill.chunk_tokens / self.rates.prefill_tokens_per_s
        if replica.num_running:
            step_s += self.rates.decode_step_s(replica.num_running)
        replica.prefill_step_s = step_s
        replica.version += 1
        self._retime_decodes(replica)
        prefill.timer += 1
        self._push(self.now_s + extra_s + step_s, _CHUNK_DONE, (replica, prefill, prefill.timer))

    def _finish_chunk(self, replica: SimReplica, prefill: Prefill, records) -> None:
        """A step boundary: the prefill ends with its last chunk; else it waits with the other
        admitted ones while the decodes take the blocks they have grown into and the next
        chunk is chosen (maybe its own, maybe a shorter request's)."""
        prefill.num_computed += prefill.chunk_tokens
        if prefill.num_computed >= prefill.num_tokens:
            self._finish_prefill(replica, prefill, records)
            return
        replica.prefill = None
        replica.paused.append(prefill)
        self._start_prefill(replica, after_prefill=True)
        if not replica.prefilling:
            self._retime_decodes(replica)  # decode-only steps until blocks are freed

    def _preempt_prefill(self, replica: SimReplica, prefill: Prefill) -> None:
        """Preempts a paused prefill (preemptions happen between steps, where every admitted
        prefill is paused): the prompt blocks its finished chunks computed stay in the prefix
        cache (so it recomputes only the rest), its other slots are freed and it goes back to
        the head of the queue."""
        req, bs = prefill.request, self.config.block_size
        replica.paused.remove(prefill)
        num_done = prefill.num_device_blocks + prefill.num_host_blocks
        num_done = min(len(req.block_ids), num_done + prefill.num_computed // bs)
        done = req.block_ids[:num_done]
        replica.cache.commit(done, prefill.num_device_blocks)
        replica.cache.release(done)
        replica.cache.unreserve(prefill.num_slots - (num_done - prefill.num_device_blocks))
        start = prefill.num_device_blocks + prefill.num_host_blocks
        woken = self._stop_computing(replica, req, start)
        replica.queue.appendleft(req)
        num_queued = self._tokens_to_admit(replica, req)
        replica.num_queued_prefill_tokens += (
            num_queued - replica.queued_tokens_by_request[req.request_id]
        )
        replica.queued_tokens_by_request[req.request_id] = num_queued
        self.num_preemptions += 1
        replica.version += 1
        self._retime_decodes(replica)
        self._wake(replica, woken)

    def _stop_computing(self, replica: SimReplica, req: Request, start: int) -> set[int]:
        """``req``'s blocks from ``start`` are no longer being computed on ``replica``; returns
        the peers with a request waiting for one of them (pulls on only)."""
        woken: set[int] = set()
        replica.in_flight.difference_update(req.block_ids[start:])
        if self.config.pull is None:
            return woken
        for block in req.block_ids[start:]:
            count = self.computing.get(block, 0) - 1
            if count > 0:
                self.computing[block] = count
            else:
                self.computing.pop(block, None)
            woken |= self.waiters.pop(block, set())
        return woken

    def _wake(self, replica: SimReplica, woken: set[int]) -> None:
        """Starts the idle prefill servers of the peers in ``woken``."""
        for i in sorted(woken - {replica.index}):
            peer = self.replicas[i]
            if peer.queue and not peer.prefilling:
                self._start_prefill(peer)

    def _generated_blocks(self, req: Request, num_generated: int) -> int:
        """Blocks beyond the prompt's that ``num_generated`` output tokens occupy."""
        size = self.config.block_size
        return math.ceil((req.num_prompt_tokens + num_generated) / size) - math.ceil(
            req.num_prompt_tokens / size
        )

    def _progress(self, decoding: Decoding) -> float:
        """Tokens ``decoding`` has generated by now (fractional: part of a step)."""
        done = decoding.tokens + (self.now_s - decoding.at_s) / decoding.interval_s
        return min(done, decoding.request.num_output_tokens)

    def _num_generated(self, decoding: Decoding) -> int:
        return int(self._progress(decoding) + 1e-9)

    def _decode_interval_s(self, replica: SimReplica) -> float:
        """A decode token's time on this replica now: a step of the prefill under way (its
        chunk shares the step with the decodes), else a decode-only step."""
        if replica.prefilling:
            return replica.prefill_step_s
        return self.rates.decode_step_s(max(replica.num_running, 1))

    def _retime_decodes(self, replica: SimReplica) -> None:
        """Move every decode's end to the replica's step length as it is now."""
        interval_s = self._decode_interval_s(replica)
        for decoding in replica.decoding.values():
            if decoding.interval_s == interval_s:
                continue
            decoding.tokens = self._progress(decoding)
            decoding.at_s = self.now_s
            decoding.interval_s = interval_s
            self._schedule_end(replica, decoding)
        self._arm_growth_check(replica)

    def _schedule_end(self, replica: SimReplica, decoding: Decoding) -> None:
        decoding.timer += 1
        left = decoding.request.num_output_tokens - decoding.tokens
        end_s = self.now_s + max(left, 0.0) * decoding.interval_s
        self._push(end_s, _DECODE_DONE, (replica, decoding, decoding.timer))

    def _arm_growth_check(self, replica: SimReplica) -> None:
        """Schedule the replica's next growth check at the moment its decodes, each taking a
        block every ``block_size`` tokens, would need more blocks than the pool has free
        (none when they all fit: their growth is taken at the replica's next event)."""
        replica.growth_timer += 1
        if replica.prefilling:
            return  # its chunk's end is the next step boundary, where the decodes grow
        free = replica.cache.capacity_blocks - replica.cache.num_busy_blocks
        size = self.config.block_size
        boundaries = []  # (time, order, decoding, generated tokens that need a new block)
        for order, decoding in enumerate(replica.decoding.values()):
            req = decoding.request
            held_tokens = math.ceil(req.num_prompt_tokens / size) + decoding.num_output_blocks
            tokens = held_tokens * size - req.num_prompt_tokens + 1
            if tokens <= req.num_output_tokens:
                at_s = decoding.at_s + (tokens - decoding.tokens) * decoding.interval_s
                boundaries.append((at_s, order, decoding, tokens))
        heapq.heapify(boundaries)
        while boundaries:
            at_s, order, decoding, tokens = heapq.heappop(boundaries)
            free -= 1
            if free < 0:
                self._push(max(at_s, self.now_s), _GROWTH, (replica, replica.growth_timer))
                return
            if tokens + size <= decoding.request.num_output_tokens:
                at_s += size * decoding.interval_s
                heapq.heappush(boundaries, (at_s, order, decoding, tokens + size))

    def _grow_decodes(self, replica: SimReplica) -> None:
        """Give each decoding request, oldest first, the blocks its tokens have grown into,
        preempting the newest admitted running request (``_newest_admitted``) while the pool
        has none left. Called between steps only."""
        cache = replica.cache
        num_running = replica.num_running
        for decoding in list(replica.decoding.values()):
            if replica.decoding.get(decoding.request.request_id) is not decoding:
                continue  # preempted for an older one's growth
            needed = self._generated_blocks(decoding.request, self._num_generated(decoding))
            needed -= decoding.num_output_blocks
            while needed > 0 and not cache.can_reserve(needed):
                victim = self._newest_admitted(replica)
                if isinstance(victim, Prefill):
                    self._preempt_prefill(replica, victim)
                    continue
                self._preempt(replica, victim)
                if victim is decoding:
                    break
            if needed > 0 and replica.decoding.get(decoding.request.request_id) is decoding:
                cache.reserve(needed)
                decoding.num_output_blocks += needed
        if replica.num_running != num_running:
            self._retime_decodes(replica)
        self._arm_growth_check(replica)

    def _preempt(self, replica: SimReplica, decoding: Decoding) -> None:
        """Preemption by recompute: free ``decoding``'s blocks (its prompt's stay cached) and
        queue it again, at the head."""
        req = decoding.request
        del replica.decoding[req.request_id]
        generated = self._num_generated(decoding)
        replica.generated_before[req.request_id] = generated
        replica.cache.unreserve(decoding.num_output_blocks)
        replica.cache.release(req.block_ids)
        replica.num_running -= 1
        self.num_preemptions += 1
        device, host = replica.cache.match(req.block_ids)
        num_queued = req.num_prompt_tokens - self._cached_tokens(req, device + host) + generated
        replica.queued_tokens_by_request[req.request_id] = num_queued
        replica.num_queued_prefill_tokens += num_queued
        replica.queue.appendleft(req)
        replica.version += 1

    @staticmethod
    def _newest_admitted(replica: SimReplica) -> Prefill | Decoding:
        """The running request admitted last, a decode or a paused prefill: the engine's
        preemption victim (asked between steps, when no chunk is under way)."""
        return max((*replica.decoding.values(), *replica.paused), key=lambda r: r.seq)

    def _finish_prefill(self, replica: SimReplica, prefill: Prefill, records) -> None:
        req = prefill.request
        replica.prefill_skips.pop(req.request_id, None)
        generated = replica.generated_before.pop(req.request_id, 0)
        num_cached_tokens = replica.first_cached_tokens.pop(req.request_id)
        record = records[req.request_id]
        if not generated:  # a preempted decode keeps its first prefill's figures
            record.num_cached_tokens = num_cached_tokens
            record.ttft_s = self.now_s - req.arrival_s
        replica.cache.commit(req.block_ids, prefill.num_device_blocks)
        start = prefill.num_device_blocks + prefill.num_host_blocks
        woken = self._stop_computing(replica, req, start)
        replica.num_queued_prefill_tokens -= replica.queued_tokens_by_request.pop(req.request_id)
        replica.num_running += 1
        replica.prefill = None
        replica.version += 1
        interval_s = self._decode_interval_s(replica)
        output_blocks = prefill.num_final_slots - (len(req.block_ids) - prefill.num_device_blocks)
        decoding = Decoding(req, prefill.seq, generated + 1, self.now_s, interval_s, output_blocks)
        replica.decoding[req.request_id] = decoding
        self._schedule_end(replica, decoding)
        self._retime_decodes(replica)
        self._grow_decodes(replica)
        if (replica.queue or replica.paused) and not replica.prefilling:
            self._start_prefill(replica, after_prefill=True)
        self._wake(replica, woken)

    def _finish_decode(self, replica: SimReplica, decoding: Decoding, records) -> None:
        req = decoding.request
        del replica.decoding[req.request_id]
        replica.num_running -= 1
        replica.num_inflight -= 1
        replica.num_served += 1
        replica.cache.unreserve(decoding.num_output_blocks)
        replica.cache.release(req.block_ids)
        replica.num_pulls.pop(req.request_id, None)
        replica.version += 1
        record = records[req.request_id]
        record.finish_s = self.now_s
        replica.metrics.record_finish(self.now_s - req.arrival_s - record.ttft_s)
        done = getattr(self.policy, "on_finished", None)
        if done is not None:
            done(self, req, replica.index)
        self._retime_decodes(replica)
        if replica.queue and not replica.prefilling:  # blocks freed: a step boundary
            self._start_prefill(replica, after_prefill=True)

    def _summarize(
        self, workload: Workload, records, oracle_hit_tokens: int, pooled_hit_tokens: int, wall_s
    ):
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
            pulled_token_rate=sum(rec.num_pulled_tokens for rec in records) / prompt_tokens,
            num_dedup_deferrals=self.num_dedup_deferrals,
            num_kv_waits=self.num_kv_waits,
            num_preemptions=self.num_preemptions,
            oracle_hit_rate=oracle_hit_tokens / prompt_tokens,
            pooled_hit_rate=pooled_hit_tokens / prompt_tokens,
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p90_s=percentile(ttfts, 90),
            ttft_p99_s=percentile(ttfts, 99),
            ttft_mean_s=sum(ttfts) / len(ttfts),
            throughput_tok_s=(prompt_tokens + output_tokens) / span_s,
            output_throughput_tok_s=output_tokens / span_s,
            max_mean_load=max(loads) / (sum(loads) / len(loads)),
            sim_wall_s=wall_s,
        )
