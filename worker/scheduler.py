"""``Scheduler``: decides which requests compute how many tokens this step.

Token-budget continuous batching in the style of vLLM v1. Each step has a budget of
``max_num_batched_tokens``; decodes (1 token each) come first, and prefill work (a running
request's next chunk, or admitting a waiting request) shares the rest in the order
``prefill_order`` gives:

- ``fcfs``: running requests in admission order, then waiting ones strictly first-come
  first-served while the budget, ``max_num_seqs`` and free blocks allow (vLLM v1's order).
- ``shortest_first`` (the default): fewest tokens left to compute first, ties in arrival
  order. A request whose prompt is mostly a prefix-cache hit is not stuck behind a cold
  prompt's chunks (SGLang's longest-prefix-match order has the same aim), and equal prompts
  go one after the other rather than sharing steps, which would delay them all. A request
  overtaken ``MAX_PREFILL_SKIPS`` times goes first from then on, so none starves.
- A request that resumes a stream another replica started (its replica died mid-stream)
  joins at the head of the queue and, under ``shortest_first``, goes first like a starving
  one: its client has been waiting since the failure.

- Chunked prefill: a prompt longer than the remaining budget is computed over several steps.
- Preemption by recompute: when a running request needs a block and none is free, the latest
  admitted running request is preempted: its blocks are freed (they stay in the prefix cache,
  so the recompute is mostly a cache hit) and it goes back to the head of the queue.
- No starvation for blocks: admission stops at the first waiting request (in either order)
  that does not fit in the free blocks, so requests after it never take the blocks it needs.
- In-flight prefix dedup: a waiting request whose next prompt block another running request
  is computing right now waits for it (and then finds it in the prefix cache) instead of
  computing it a second time; requests behind it are admitted meanwhile, as SGLang does. The
  siblings of an ``n > 1`` request share their prompt this way.
- LoRA slots: the running requests use at most ``max_loras`` distinct adapters (the device
  slots a step's adapters must fit in); a waiting request of another adapter waits, and the
  requests behind it may go ahead.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from router.protocol import BlockHash
from worker.block_pool import BlockPool, NoFreeBlocksError
from worker.config import EngineConfig
from worker.request import Request, Status, cdiv


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    fed: Any = None
    """The step before's sampled ids on the device, when this step was scheduled ahead of
    them (``async_scheduling``): a sequence's token in flight is ``fed[req.in_flight_row]``
    (for the simulated engine, the step before's ``SimLogits``, whose tokens those are)."""

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def without_finished(self) -> ScheduledBatch:
        """The batch less the requests that finished since it was scheduled (aborted while
        its forward pass ran): nothing of the step is committed for them."""
        kept = [
            (req, num_new)
            for req, num_new in zip(self.requests, self.num_new_tokens, strict=True)
            if req.status is not Status.FINISHED
        ]
        return ScheduledBatch([req for req, _ in kept], [num_new for _, num_new in kept])


@dataclass
class SchedulerCounters:
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    """Hits from either tier."""
    host_cache_hits_tokens: int = 0
    """The part of the hits brought back from the host tier."""
    num_preemptions: int = 0
    num_dedup_deferrals: int = 0
    """Admissions passed over because the request's next prompt block was being computed."""


MAX_PREFILL_SKIPS = 16
"""With ``shortest_first``: a request overtaken this many steps (left out of a step in which a
younger request got prefill tokens) goes first from then on, for the budget and for blocks, so
a long prompt under a steady stream of short ones still gets its turn."""


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()

    def add(self, request: Request) -> None:
        """Queues ``request``: at the tail, or at the head when it resumes a stream another
        replica started (``Request.resume``), as a preempted request goes back."""
        if request.num_resumed_tokens:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def queued_prefill_tokens(self) -> int:
        waiting = sum(
            r.num_tokens - max(r.num_computed_tokens, r.num_cached_tokens_seen)
            for r in self.waiting
        )
        # A running request still prefilling has every token past its computed ones to go (the
        # last prompt token included: it is what the first sample reads); a decode has none.
        prefilling = (r for r in self.running if r.num_computed_tokens < r.num_tokens - 1)
        return waiting + sum(r.num_tokens - r.num_computed_tokens for r in prefilling)

    # -- the step's plan ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        preempted_now: set[Request] = set()  # requests hash by identity
        if self.config.prefill_order == "fcfs":
            budget = self._continue_running(batch, list(self.running), budget, preempted_now)
            if not preempted_now:
                self._admit(batch, budget)
            return batch
        decoding, prefilling = [], []  # one pass, running order kept in each
        for r in self.running:  # known tokens (``num_known_tokens``) less those computed
            if len(r.all_token_ids) + r.num_in_flight - r.num_computed_tokens <= 1:
                decoding.append(r)
            else:
                prefilling.append(r)
        budget = self._continue_running(batch, decoding, budget, preempted_now)
        if preempted_now:  # victims of the decodes' growth left the running set
            prefilling = [r for r in prefilling if r not in preempted_now]
        self._shortest_first(batch, prefilling, budget, preempted_now)
        return batch

    def _continue_running(
        self, batch: ScheduledBatch, requests: list[Request], budget: int, preempted_now: set
    ) -> int:
        """Give each running request its next tokens in turn, preempting the newest running
        request when blocks run out; returns the budget left."""
        block_size = self.pool.block_size
        scheduled, counts = batch.requests, batch.num_new_tokens
        for req in requests:  # once per running request per step: plain reads
            if budget == 0:
                break
            if preempted_now and req in preempted_now:
                continue
            in_flight = req.num_in_flight
            if in_flight and req.ends_with_in_flight():
                continue  # its token in flight finishes it: nothing to compute past it
            computed = req.num_computed_tokens
            num_new = min(len(req.all_token_ids) + in_flight - computed, budget)
            if computed + num_new > len(req.block_ids) * block_size and not (
                self._grow_or_preempt(req, num_new, batch, preempted_now)
            ):
                continue  # it needed a block and was itself preempted
            scheduled.append(req)
            counts.append(num_new)
            budget -= num_new
        return budget

    def _grow_or_preempt(
        self, req: Request, num_new: int, batch: ScheduledBatch, preempted_now: set
    ) -> bool:
        """Make ``req`` hold blocks for ``num_new`` more tokens, preempting the newest running
        request not already in this step's batch while blocks are short. False when ``req``
        itself was the one preempted."""
        while not self._grow(req, num_new):
            scheduled = set(batch.requests)  # only when blocks are short: this step's so far
            victim = [r for r in self.running if r not in scheduled][-1]  # req is among them
            self._preempt(victim)
            preempted_now.add(victim)
            if victim is req:
                return False
        return True

    def _shortest_first(
        self, batch: ScheduledBatch, prefilling: list[Request], budget: int, preempted_now: set
    ) -> None:
        """Prefill work for ``prefill_order="shortest_first"`` (see the module docstring)."""
        # Waiting requests compete only while a seat is free and no one was preempted this step,
        # and only the first max_num_seqs of them (a bounded look-ahead keeps a step's planning
        # cost flat in the queue depth).
        seats_free = len(self.running) < self.config.max_num_seqs and not preempted_now
        lookahead = self.config.max_num_seqs if seats_free else 0
        window = list(itertools.islice(self.waiting, lookahead))
        if not window and not prefilling:  # decodes only: nothing more to plan
            return
        in_flight = self._blocks_in_flight() if window else set()

        def priority(req: Request) -> tuple[bool, int, float]:
            starving = req.num_prefill_skips >= MAX_PREFILL_SKIPS or req.num_resumed_tokens > 0
            if req.status == Status.RUNNING:
                left = req.num_tokens - req.num_computed_tokens
            else:
                req.num_cached_tokens_seen = self._cached_prefix_tokens(req)
                left = req.num_tokens - req.num_cached_tokens_seen
            # Starving ones first, oldest first; then fewest tokens left, ties by arrival.
            return (not starving, left if not starving else 0, req.arrival_time)

        admitting = True  # until a waiting request does not fit: none after it may take blocks
        candidates = sorted([*prefilling, *window], key=priority)
        for req in candidates:
            if budget <= 0:
                break
            if req in preempted_now:
                continue
            if req.status == Status.RUNNING:
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if self._grow_or_preempt(req, num_new, batch, preempted_now):
                    batch.requests.append(req)
                    batch.num_new_tokens.append(num_new)
                    budget -= num_new
                admitting = admitting and not preempted_now  # a step that preempted admits none
            elif (
                admitting
                and len(self.running) < self.config.max_num_seqs
                and self._adapter_fits(req)
            ):
                num_new = self._admit_one(batch, req, budget, in_flight)
                admitting = num_new is not None
                budget -= num_new or 0
        # A request left out while a younger one got prefill tokens was overtaken: one skip.
        served = set(batch.requests)
        youngest = max((r.arrival_time for r in candidates if r in served), default=None)
        for req in candidates:
            if youngest is not None and req not in served and req.arrival_time < youngest:
                req.num_prefill_skips += 1

    def _adapter_fits(self, req: Request) -> bool:
        """Whether admitting ``req`` keeps the running requests' distinct LoRA adapters within
        ``max_loras`` (the device slots every step's adapters must fit in)."""
        if not req.lora_id:
            return True
        running = {r.lora_id for r in self.running if r.lora_id}
        return req.lora_id in running or len(running) < self.config.max_loras

    def _cached_prefix_tokens(self, req: Request) -> int:
        """Prompt tokens a waiting request would find in the device prefix cache now."""
        hashes = req.block_hashes[: self._max_hit_blocks(req)]
        return len(self.pool.find_cached_prefix(hashes, req.all_token_ids)) * self.pool.block_size

    def _max_hit_blocks(self, req: Request) -> int:
        # Never a full hit: the last token is recomputed so the step yields its logits.
        if req.needs_prompt_logits:
            return 0  # prompt logprobs need every prompt position's logits
        return (req.num_tokens - 1) // self.pool.block_size

    def _grow(self, req: Request, num_new: int) -> bool:
        """Make ``req`` hold blocks for ``num_computed_tokens + num_new`` tokens."""
        needed = cdiv(req.num_computed_tokens + num_new, self.pool.block_size) - len(req.block_ids)
        if needed <= 0:
            return True
        try:
            fresh = self.pool.allocate(needed)
        except NoFreeBlocksError:
            return False
        req.blocks += fresh
        req.block_ids += [b.block_id for b in fresh]
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.blocks)
        req.blocks, req.block_ids = [], []
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting requests in arrival order while budget, seats and blocks last.

        A request whose next uncached prompt block is being computed right now by a running
        request (in-flight prefix dedup) is passed over, not admitted: it waits in place for
        those blocks to land in the prefix cache, while the requests behind it go ahead. It
        is admitted as soon as its next block is no longer in flight, so it waits at most as
        long as that prefill takes. Any other request that does not fit stops admission.
        """
        in_flight = self._blocks_in_flight()
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._adapter_fits(req):
                continue  # waits for a slot; the requests behind it may go ahead
            num_new = self._admit_one(batch, req, budget, in_flight)
            if num_new is None:
                break
            budget -= num_new

    def _admit_one(
        self, batch: ScheduledBatch, req: Request, budget: int, in_flight: set[BlockHash]
    ) -> int | None:
        """Admit ``req`` with up to ``budget`` new tokens: the number scheduled, 0 when it
        waits for a prompt block in flight, None when its blocks do not fit."""
        hashes = req.block_hashes[: self._max_hit_blocks(req)]
        hits = self.pool.find_cached_prefix(hashes, req.all_token_ids)
        if len(hits) < len(hashes) and hashes[len(hits)] in in_flight:
            self.counters.num_dedup_deferrals += 1
            return 0
        self.pool.touch(hits)
        host_hits = self.pool.load_host_prefix(hashes, req.all_token_ids, start=len(hits))
        hits += host_hits
        num_hit_tokens = len(hits) * self.pool.block_size
        num_new = min(req.num_tokens - num_hit_tokens, budget)
        needed = cdiv(num_hit_tokens + num_new, self.pool.block_size) - len(hits)
        try:
            fresh = self.pool.allocate(needed)
        except NoFreeBlocksError:
            self.pool.free(hits)
            return None
        self.waiting.remove(req)
        req.blocks = hits + fresh
        req.block_ids = [b.block_id for b in req.blocks]
        req.num_computed_tokens = num_hit_tokens
        req.status = Status.RUNNING
        if req.num_cached_tokens is None:
            req.first_scheduled_time = time.monotonic()
            req.num_cached_tokens = min(num_hit_tokens, len(req.prompt_token_ids))
            self.counters.prefix_cache_queries_tokens += len(req.prompt_token_ids)
            self.counters.prefix_cache_hits_tokens += req.num_cached_tokens
            self.counters.host_cache_hits_tokens += len(host_hits) * self.pool.block_size
        self.running.append(req)
        if self.pool.enable_prefix_caching:
            in_flight.update(self._uncomputed_hashes(req))
        batch.requests.append(req)
        batch.num_new_tokens.append(num_new)
        return num_new

    def _blocks_in_flight(self) -> set[BlockHash]:
        """Hashes of the prompt blocks running requests hold but have not computed yet."""
        if not self.pool.enable_prefix_caching:
            return set()
        return {h for req in self.running for h in self._uncomputed_hashes(req)}

    def _uncomputed_hashes(self, req: Request) -> list[BlockHash]:
        return req.block_hashes[req.num_computed_tokens // self.pool.block_size :]

    # -- after the step ----------------------------------------------------------------------
    def commit_computed(self, batch: ScheduledBatch) -> None:
        """Advance ``num_computed_tokens`` and cache every block that is now full and computed."""
        bs = self.pool.block_size
        for req, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            before = req.num_computed_tokens // bs
            req.num_computed_tokens += num_new
            filled = req.num_computed_tokens // bs
            if filled == before:  # most decodes: no block filled
                continue
            for i in range(before, min(filled, len(req.block_hashes))):
                self.pool.cache_block(
                    req.blocks[i], req.block_hashes[i], req.all_token_ids[i * bs : (i + 1) * bs]
                )

    def check_invariants(self) -> None:
        """The block pool's invariants (``BlockPool.check_invariants``), and every queued or
        running request's ``block_ids`` naming its blocks; an ``AssertionError`` if not."""
        self.pool.check_invariants()
        for req in (*self.running, *self.waiting):
            if req.block_ids != [b.block_id for b in req.blocks]:
                raise AssertionError(f"{req.request_id}: block_ids disagree with its blocks")

    def finish(self, req: Request) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self.pool.free(req.blocks)
        req.blocks, req.block_ids = [], []
        req.status = Status.FINISHED
