"""``Scheduler``: decides which requests compute how many tokens this step.

Token-budget continuous batching in the style of vLLM v1. Each step has a budget of
``max_num_batched_tokens``; running requests are served first (a decode costs 1 token, a
prefill chunk up to the rest of the budget), then waiting requests are admitted strictly
first-come first-served while the budget, ``max_num_seqs`` and free blocks allow.

- Chunked prefill: a prompt longer than the remaining budget is computed over several steps.
- Preemption by recompute: when a running request needs a block and none is free, the latest
  admitted running request is preempted: its blocks are freed (they stay in the prefix cache,
  so the recompute is mostly a cache hit) and it goes back to the head of the queue.
- No starvation: admission stops at the first waiting request that does not fit, so later
  requests (even ones whose prefix is already cached) never overtake it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.block_pool import BlockPool, NoFreeBlocksError
from worker.config import EngineConfig
from worker.request import Request, Status, cdiv


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


@dataclass
class SchedulerCounters:
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    """Hits from either tier."""
    host_cache_hits_tokens: int = 0
    """The part of the hits brought back from the host tier."""
    num_preemptions: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def queued_prefill_tokens(self) -> int:
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        # A running request still prefilling has every token past its computed ones to go (the
        # last prompt token included: it is what the first sample reads); a decode has none.
        prefilling = (r for r in self.running if r.num_computed_tokens < r.num_tokens - 1)
        return waiting + sum(r.num_tokens - r.num_computed_tokens for r in prefilling)

    # -- the step's plan ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        preempted_now: set[int] = set()
        for req in list(self.running):
            if budget == 0:
                break
            if id(req) in preempted_now:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._grow(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted_now.add(id(victim))
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                continue
            batch.requests.append(req)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        if not preempted_now:
            self._admit(batch, budget)
        return batch

    def _grow(self, req: Request, num_new: int) -> bool:
        """Make ``req`` hold blocks for ``num_computed_tokens + num_new`` tokens."""
        needed = cdiv(req.num_computed_tokens + num_new, self.pool.block_size) - len(req.blocks)
        if needed <= 0:
            return True
        try:
            req.blocks += self.pool.allocate(needed)
        except NoFreeBlocksError:
            return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.must_wait_for_sibling():
                break
            # Never a full hit: the last token is recomputed so the step yields its logits.
            max_hit_blocks = (req.num_tokens - 1) // self.pool.block_size
            if req.needs_prompt_logits:
                max_hit_blocks = 0  # prompt logprobs need every prompt position's logits
            hashes = req.block_hashes[:max_hit_blocks]
            hits = self.pool.find_cached_prefix(hashes, req.all_token_ids)
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
                break
            self.waiting.popleft()
            req.blocks = hits + fresh
            req.num_computed_tokens = num_hit_tokens
            req.status = Status.RUNNING
            if req.num_cached_tokens is None:
                req.num_cached_tokens = min(num_hit_tokens, len(req.prompt_token_ids))
                self.counters.prefix_cache_queries_tokens += len(req.prompt_token_ids)
                self.counters.prefix_cache_hits_tokens += req.num_cached_tokens
                self.counters.host_cache_hits_tokens += len(host_hits) * self.pool.block_size
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    # -- after the step ----------------------------------------------------------------------
    def commit_computed(self, batch: ScheduledBatch) -> None:
        """Advance ``num_computed_tokens`` and cache every block that is now full and computed."""
        bs = self.pool.block_size
        for req, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            before = req.num_computed_tokens // bs
            req.num_computed_tokens += num_new
            for i in range(before, min(req.num_computed_tokens // bs, len(req.block_hashes))):
                self.pool.cache_block(req.blocks[i], req.block_hashes[i], req.all_token_ids[i * bs : (i + 1) * bs])

    def finish(self, req: Request) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.status = Status.FINISHED
