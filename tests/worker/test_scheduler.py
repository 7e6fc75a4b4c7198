"""Scheduler policy without a model: real ``Scheduler``, ``BlockPool`` and ``Request`` objects,
driven by hand the way ``LLMEngine.step`` drives them (schedule -> commit_computed -> sample ->
finish), with made-up tokens standing in for the model's.

Covers both prefill orders (``fcfs``: arrival order without starvation; ``shortest_first``:
fewest tokens left first, with its starvation bound), which request preemption picks and how
it comes back, the per-step token budget and ``max_num_seqs``, in-flight prefix dedup (siblings
of an ``n > 1`` request included), never a full prefix-cache hit, and
``queued_prefill_tokens``.
"""

from __future__ import annotations

import itertools
import random

import pytest

from worker.block_pool import BlockPool
from worker.config import PREFILL_ORDERS, EngineConfig
from worker.request import Request, Status, cdiv
from worker.sampling_params import SamplingParams
from worker.scheduler import MAX_PREFILL_SKIPS, ScheduledBatch, Scheduler

BS = 8
"""Block size of every test here: the smallest ``EngineConfig`` accepts, so cases stay small."""

_token_ids = itertools.count(1000)
"""Fresh token ids: prompts never share a block by accident, and sampled tokens are unique."""


def tokens(n: int) -> list[int]:
    return [next(_token_ids) for _ in range(n)]


def make_scheduler(
    *,
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 16,
    enable_prefix_caching: bool = True,
    prefill_order: str = EngineConfig.prefill_order,
) -> Scheduler:
    config = EngineConfig(
        block_size=BS,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        prefill_order=prefill_order,
    )
    return Scheduler(config, BlockPool(num_blocks, BS, enable_prefix_caching))


def make_request(name: str, prompt: list[int], max_tokens: int = 4, index: int = 0) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id=name,
        index=index,
        prompt_token_ids=list(prompt),
        params=params,
        seed=0,
        block_size=BS,
        model_id="test-model",
        cache_salt=None,
        detokenizer=None,
        max_total_tokens=10_000,
    )


def step(sched: Scheduler) -> ScheduledBatch:
    """One engine step with a made-up model: every request whose step reaches its last known
    token samples one new token; a request at ``max_tokens`` finishes (as in ``LLMEngine``)."""
    batch = sched.schedule()
    sampling = [
        r
        for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
        if r.num_computed_tokens + n == r.num_tokens
    ]
    sched.commit_computed(batch)
    for req in sampling:
        req.append_token(next(_token_ids))
        if req.max_tokens_reached():
            sched.finish(req)
    sched.check_invariants()
    return batch


def plan(batch: ScheduledBatch) -> list[tuple[str, int]]:
    """The step's plan as ``(request_id, num_new_tokens)``, in batch order."""
    return [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def run_until_idle(sched: Scheduler, max_steps: int = 1000) -> list[ScheduledBatch]:
    batches = []
    while sched.num_unfinished:
        assert len(batches) < max_steps, (
            f"still {ids(sched.waiting)} waiting, {ids(sched.running)} running"
        )
        batches.append(step(sched))
    return batches


# -- (1) first come, first served --------------------------------------------------------------
def test_fcfs_admits_in_arrival_order_and_chunks_the_one_the_budget_cuts():
    sched = make_scheduler(budget=48, prefill_order="fcfs")
    a, b, c = (
        make_request("a", tokens(20)),
        make_request("b", tokens(20)),
        make_request("c", tokens(5)),
    )
    for r in (a, b, c):
        sched.add(r)
    assert plan(step(sched)) == [("a", 20), ("b", 20), ("c", 5)]
    assert ids(sched.running) == ["a", "b", "c"]

    sched = make_scheduler(budget=32, prefill_order="fcfs")
    a, b, c = (
        make_request("a", tokens(20)),
        make_request("b", tokens(20)),
        make_request("c", tokens(5)),
    )
    for r in (a, b, c):
        sched.add(r)
    # b gets what is left of the budget; c, though short, does not jump ahead of it.
    assert plan(step(sched)) == [("a", 20), ("b", 12)]
    assert ids(sched.waiting) == ["c"]


def test_fcfs_later_short_request_never_overtakes_a_waiting_one_that_does_not_fit():
    sched = make_scheduler(num_blocks=7, prefill_order="fcfs")
    running = make_request("running", tokens(30), max_tokens=3)  # 4 blocks to the end
    sched.add(running)
    step(sched)
    long = make_request("long", tokens(32))  # needs 4 blocks; 3 are free
    # Fits in the free blocks, and its first block is even in the prefix cache.
    short = make_request("short", running.prompt_token_ids[:9])
    sched.add(long)
    sched.add(short)
    for _ in range(2):
        assert plan(step(sched)) == [("running", 1)]
        assert ids(sched.waiting) == ["long", "short"]
    assert running.is_finished
    assert plan(step(sched)) == [("long", 32), ("short", 1)]
    assert short.num_cached_tokens == BS


def test_fcfs_waiting_request_is_admitted_with_whatever_budget_is_left():
    sched = make_scheduler(budget=16, prefill_order="fcfs")
    decoders = [make_request(f"d{i}", tokens(5), max_tokens=50) for i in range(2)]
    for r in decoders:
        sched.add(r)
    step(sched)
    long, short = make_request("long", tokens(40)), make_request("short", tokens(3))
    sched.add(long)
    sched.add(short)
    assert plan(step(sched)) == [("d0", 1), ("d1", 1), ("long", 14)]
    assert ids(sched.waiting) == ["short"]


# -- (2) preemption by recompute ----------------------------------------------------------------
def test_out_of_blocks_in_decode_preempts_the_newest_running_request():
    sched = make_scheduler(num_blocks=6)
    a, b, c = (make_request(n, tokens(15), max_tokens=4) for n in "abc")  # 2 blocks each: pool full
    for r in (a, b, c):
        sched.add(r)
    step(sched)  # prefill, sample token 16
    step(sched)  # decode position 15: still 2 blocks each
    late = make_request("late", tokens(1))
    sched.add(late)
    assert sched.pool.num_free_blocks == 0 and all(r.num_tokens == 17 for r in (a, b, c))

    batch = step(sched)  # a and b each need a third block: c, the newest, makes room
    assert plan(batch) == [("a", 1), ("b", 1)]
    assert c.status == Status.WAITING and c.blocks == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.counters.num_preemptions == 1
    assert ids(sched.waiting) == ["c", "late"], (
        "the preempted request goes back to the head of the queue"
    )
    assert sum(blk.ref_count for blk in sched.pool.blocks) == len(a.blocks) + len(b.blocks) == 6
    assert len(c.output_token_ids) == 2, "its sampled tokens are kept"
    assert sched.queued_prefill_tokens() == c.num_tokens + late.num_tokens

    while c.status == Status.WAITING:
        batch = step(sched)
    # a and b took c's two blocks (evicting them), so c recomputes all 17 tokens, the 2 it
    # generated included, and samples its next one in the same step.
    assert ("c", 17) in plan(batch) and len(c.output_token_ids) == 3
    run_until_idle(sched)
    assert all(r.is_finished and len(r.output_token_ids) == 4 for r in (a, b, c, late))
    assert sched.counters.prefix_cache_queries_tokens == 3 * 15 + 1, (
        "a recompute is not a second query"
    )
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


@pytest.mark.parametrize("order", PREFILL_ORDERS)
def test_no_admission_in_a_step_that_preempted(order):
    sched = make_scheduler(num_blocks=6, prefill_order=order)
    a = make_request("a", tokens(23), max_tokens=10)
    b = make_request("b", tokens(23), max_tokens=10)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert sched.pool.num_free_blocks == 0 and a.num_tokens == b.num_tokens == 25
    sched.add(make_request("c", tokens(3)))
    # a needs a fourth block: b is preempted and a takes one of its three. c would fit in the
    # two left, but a step that preempted admits nobody.
    assert plan(step(sched)) == [("a", 1)]
    assert sched.pool.num_free_blocks == 2 and ids(sched.waiting) == ["b", "c"]
    if order == "fcfs":  # next step b (4 blocks now) still does not fit; c never overtakes it
        assert plan(step(sched)) == [("a", 1)]
    else:  # c, with fewer tokens to compute, goes first and fits; b waits for blocks
        assert plan(step(sched)) == [("a", 1), ("c", 3)]
        assert ids(sched.waiting) == ["b"] and b.num_prefill_skips == 1


def test_a_request_alone_without_a_block_preempts_itself():
    sched = make_scheduler(num_blocks=2)
    a = make_request("a", tokens(15), max_tokens=3)
    sched.add(a)
    step(sched)
    step(sched)
    assert sched.pool.num_free_blocks == 0 and a.num_tokens == 17  # no third block for a
    # With no other victim, a is the newest running request: it goes back to the queue.
    assert not step(sched)
    assert a.status == Status.WAITING and ids(sched.waiting) == ["a"] and a.blocks == []


def test_shortest_first_never_preempts_a_request_already_in_the_step():
    """Decodes are planned before prefills; a prefill then short of a block may preempt only a
    request not yet in the step's batch (here itself), never the decode already planned."""
    sched = make_scheduler(num_blocks=5, budget=16)
    old, new = make_request("old", tokens(40)), make_request("new", tokens(4), max_tokens=20)
    sched.add(old)
    assert plan(step(sched)) == [("old", 16)]
    sched.add(new)
    assert plan(step(sched)) == [("new", 4), ("old", 12)]  # old: 4 blocks, new: 1; pool full
    batch = step(sched)  # old needs a fifth block; new, the newest, is already planned
    assert plan(batch) == [("new", 1)]
    assert old.status == Status.WAITING and old.num_preemptions == 1
    assert new.status == Status.RUNNING and new.blocks


# -- (3) the token budget and max_num_seqs --------------------------------------------------------
def test_chunked_prefill_then_decodes_share_the_budget():
    sched = make_scheduler(budget=16)
    a = make_request("a", tokens(40), max_tokens=10)
    sched.add(a)
    chunks = []
    while not a.output_token_ids:
        chunks.append(plan(step(sched)))
    assert chunks == [[("a", 16)], [("a", 16)], [("a", 8)]], "a samples only after its last chunk"
    b = make_request("b", tokens(40))
    sched.add(b)
    assert [plan(step(sched)) for _ in range(3)] == [
        [("a", 1), ("b", 15)],
        [("a", 1), ("b", 15)],
        [("a", 1), ("b", 10)],
    ]
    assert len(b.output_token_ids) == 1


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(budget=64, max_num_seqs=2)
    reqs = [make_request(f"r{i}", tokens(4), max_tokens=3) for i in range(3)]
    for r in reqs:
        sched.add(r)
    assert plan(step(sched)) == [("r0", 4), ("r1", 4)]
    assert ids(sched.waiting) == ["r2"]
    while not reqs[0].is_finished:
        assert ids(step(sched).requests) == ["r0", "r1"]
    assert ("r2", 4) in plan(step(sched))


@pytest.mark.parametrize("order", PREFILL_ORDERS)
def test_random_load_respects_budget_and_max_num_seqs(test_seed, order):
    rng = random.Random(test_seed)
    budget, max_num_seqs = 24, 4
    sched = make_scheduler(
        num_blocks=20, budget=budget, max_num_seqs=max_num_seqs, prefill_order=order
    )
    shared = tokens(2 * BS)
    pending = [
        make_request(
            f"r{i}",
            shared[: rng.choice([0, BS, 2 * BS])] + tokens(rng.randint(1, 60)),
            max_tokens=rng.randint(1, 10),
        )
        for i in range(40)
    ]
    everyone, steps = list(pending), 0
    while pending or sched.num_unfinished:
        while pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        batch = step(sched)
        steps += 1
        assert batch.total_tokens <= budget, f"seed {test_seed}: {plan(batch)}"
        assert len(sched.running) <= max_num_seqs
        assert all(n >= 1 for n in batch.num_new_tokens)
        assert len(set(map(id, batch.requests))) == len(batch.requests), (
            "a request twice in one step"
        )
        assert steps < 3000, f"seed {test_seed}: requests left after {steps} steps"
    assert all(r.is_finished and len(r.output_token_ids) == r.params.max_tokens for r in everyone)
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


# -- (4) in-flight prefix dedup (and siblings of an n > 1 request) -------------------------------
def make_group(name: str, prompt: list[int], n: int) -> list[Request]:
    """``n`` sequences of one request, as ``LLMEngine.add_request`` makes them."""
    return [make_request(name, prompt, index=i) for i in range(n)]


def test_fcfs_siblings_wait_for_the_prompt_in_flight_and_others_go_ahead():
    sched = make_scheduler(budget=16, prefill_order="fcfs")
    first, s1, s2 = make_group("g", tokens(40), 3)
    other = make_request("other", tokens(2))
    for r in (first, s1, s2, other):
        sched.add(r)
    # The first sibling computes the prompt in chunks of the budget; the others wait for its
    # blocks instead of computing them again, and "other" takes the budget left over.
    assert plan(step(sched)) == [("g", 16)]
    assert plan(step(sched)) == [("g", 16)]
    # The prompt's first four blocks are cached now: s1 hits them and computes its last block
    # (the prompt's last token is always computed), which takes the rest of the budget.
    assert plan(step(sched)) == [("g", 8), ("g", 8)]
    assert ids(sched.waiting) == ["g", "other"]
    batch = step(sched)
    assert batch.requests == [first, s1, s2, other]
    assert batch.num_new_tokens == [1, 1, 8, 2]
    assert s1.num_cached_tokens == s2.num_cached_tokens == 32
    shared_ids = [blk.block_id for blk in first.blocks[:4]]
    assert (
        [blk.block_id for blk in s1.blocks[:4]]
        == [blk.block_id for blk in s2.blocks[:4]]
        == shared_ids
    ), "the shared prompt blocks are computed once"


def test_sibling_of_a_finished_first_does_not_wait():
    sched = make_scheduler()
    first, second = make_group("g", tokens(20), 2)
    sched.add(first)
    sched.add(second)
    sched.finish(first)  # aborted before it ran
    batch = step(sched)
    assert batch.requests == [second] and batch.num_new_tokens == [20]


@pytest.mark.parametrize("order", PREFILL_ORDERS)
def test_requests_sharing_a_prefix_submitted_at_once_prefill_it_once(order):
    """N requests with one long common prefix and their own tails, all arriving in one step:
    the prefix is computed once, every later request hits it, nobody is blocked for good."""
    sched = make_scheduler(num_blocks=128, budget=64, max_num_seqs=8, prefill_order=order)
    prefix = tokens(6 * BS)
    group = [make_request(f"r{i}", prefix + tokens(5), max_tokens=3) for i in range(6)]
    for r in group:
        sched.add(r)
    batches = run_until_idle(sched)
    assert all(r.num_cached_tokens == len(prefix) for r in group[1:])
    assert sched.counters.num_dedup_deferrals >= len(group) - 1
    computed = sum(b.total_tokens for b in batches)
    decodes = sum(len(r.output_token_ids) - 1 for r in group)
    assert computed - decodes == len(prefix) + 6 * 5, "the prefix is computed exactly once"
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


def test_fcfs_deferred_request_lets_an_unrelated_one_in_and_is_admitted_when_the_block_lands():
    sched = make_scheduler(budget=48, prefill_order="fcfs")
    prefix = tokens(4 * BS)
    a = make_request("a", prefix + tokens(3))
    b = make_request("b", prefix + tokens(3))
    c = make_request("c", tokens(4))
    for r in (a, b, c):
        sched.add(r)
    # b's first block is being computed by a: b waits, c (behind it) takes the budget left.
    assert plan(step(sched)) == [("a", 35), ("c", 4)]
    assert sched.counters.num_dedup_deferrals == 1 and ids(sched.waiting) == ["b"]
    # a's prefix landed in the cache: b hits all four blocks and computes its own tail.
    assert plan(step(sched)) == [("a", 1), ("c", 1), ("b", 3)]
    assert b.num_cached_tokens == 4 * BS


def test_no_dedup_wait_without_prefix_caching():
    sched = make_scheduler(budget=64, enable_prefix_caching=False)
    prefix = tokens(4 * BS)
    for name in ("a", "b"):
        sched.add(make_request(name, prefix + tokens(3)))
    assert plan(step(sched)) == [("a", 35), ("b", 29)]
    assert sched.counters.num_dedup_deferrals == 0


# -- (5) never a full prefix-cache hit ----------------------------------------------------------
def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = make_scheduler()
    prompt = tokens(2 * BS)
    sched.add(make_request("warm", prompt, max_tokens=1))
    run_until_idle(sched)

    same = make_request("same", prompt, max_tokens=1)
    sched.add(same)
    # Both blocks are cached, but the last one is recomputed so the step yields logits.
    assert plan(step(sched)) == [("same", BS)]
    assert same.num_cached_tokens == BS and len(same.output_token_ids) == 1

    longer = make_request("longer", prompt + tokens(1), max_tokens=1)
    sched.add(longer)
    assert plan(step(sched)) == [("longer", 1)]
    assert longer.num_cached_tokens == 2 * BS and len(longer.output_token_ids) == 1
    assert sched.counters.prefix_cache_hits_tokens == 3 * BS


def test_no_hits_when_prefix_caching_is_off():
    sched = make_scheduler(enable_prefix_caching=False)
    prompt = tokens(2 * BS)
    sched.add(make_request("warm", prompt, max_tokens=1))
    run_until_idle(sched)
    again = make_request("again", prompt, max_tokens=1)
    sched.add(again)
    assert plan(step(sched)) == [("again", 2 * BS)] and again.num_cached_tokens == 0


# -- (6) queued_prefill_tokens ------------------------------------------------------------------
def test_queued_prefill_tokens_counts_waiting_prompts_and_not_decodes():
    sched = make_scheduler(budget=16, prefill_order="fcfs")
    assert sched.queued_prefill_tokens() == 0
    a, b = (
        make_request("a", tokens(40), max_tokens=20),
        make_request("b", tokens(10), max_tokens=20),
    )
    sched.add(a)
    sched.add(b)
    assert sched.queued_prefill_tokens() == 50
    step(sched)
    before = sched.queued_prefill_tokens()
    assert plan(step(sched)) == [("a", 16)]
    assert before - sched.queued_prefill_tokens() == 16, (
        "a prefill chunk leaves the queue as it computes"
    )
    while b.num_computed_tokens < len(b.prompt_token_ids):
        step(sched)
    assert a.output_token_ids and b.output_token_ids
    assert sched.queued_prefill_tokens() == 0, "decoding requests queue no prefill"


def test_queued_prefill_tokens_counts_every_token_a_partial_prefill_still_needs():
    sched = make_scheduler(budget=16, prefill_order="fcfs")
    a, b = make_request("a", tokens(40)), make_request("b", tokens(10))
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [("a", 16)]
    assert sched.queued_prefill_tokens() == (40 - 16) + 10


def test_queued_prefill_tokens_leave_out_what_a_waiting_request_finds_cached():
    """Three requests on a cached 32-token system prompt, 12 tokens of their own each, and a
    16-token budget: the first prefills its 12, the second 4 of its 12, the third waits. Its
    cached prompt is not queued work: 12 tokens for it and 8 for the second, not 44 + 8."""
    sched = make_scheduler(budget=16)
    system = tokens(4 * BS)
    sched.add(make_request("warm", system + tokens(2), max_tokens=1))
    run_until_idle(sched)
    for name in ("first", "second", "third"):
        sched.add(make_request(name, system + tokens(12)))
    assert plan(step(sched)) == [("first", 12), ("second", 4)]
    assert ids(sched.waiting) == ["third"]
    assert sched.queued_prefill_tokens() == 12 + 8


# -- (7) prefill order: shortest_first (the default) ---------------------------------------------
def test_shortest_first_serves_a_mostly_cached_prompt_before_a_cold_prompts_chunks():
    """With fcfs a request whose prompt is mostly cached waits until the cold prompt ahead of
    it has finished prefilling; with shortest_first it gets its first token the next step."""
    steps_to_first_token = {}
    for order in PREFILL_ORDERS:
        sched = make_scheduler(budget=16, prefill_order=order)
        system = tokens(4 * BS)
        sched.add(make_request("warm", system + tokens(2), max_tokens=1))
        run_until_idle(sched)
        sched.add(make_request("cold", tokens(64)))
        step(sched)  # the cold prompt's first chunk
        hit = make_request("hit", system + tokens(3))
        sched.add(hit)
        n = 0
        while not hit.output_token_ids:
            step(sched)
            n += 1
        assert hit.num_cached_tokens == 4 * BS
        steps_to_first_token[order] = n
    assert steps_to_first_token == {"shortest_first": 1, "fcfs": 4}


def test_shortest_first_runs_equal_prompts_one_after_the_other():
    """Sharing steps between equal prompts would delay both; the older one goes first."""
    sched = make_scheduler(budget=16)
    for name in "ab":
        sched.add(make_request(name, tokens(40)))
    plans = [plan(step(sched)) for _ in range(3)]
    assert plans == [[("a", 16)], [("a", 16)], [("a", 8), ("b", 8)]]


def test_shortest_first_a_long_prompt_under_a_stream_of_short_ones_gets_its_turn():
    """A short request arriving before every step fills the budget alone: the long prompt is
    overtaken until MAX_PREFILL_SKIPS, then goes first and finishes its prefill."""
    sched = make_scheduler(budget=16)
    long = make_request("long", tokens(48), max_tokens=1)
    sched.add(long)
    steps = 0
    while not long.output_token_ids:
        sched.add(make_request(f"s{steps}", tokens(16), max_tokens=1))
        batch = step(sched)
        steps += 1
        if steps <= MAX_PREFILL_SKIPS:
            assert long not in batch.requests and long.num_prefill_skips == steps
        assert steps < 100, "the long prompt starves"
    assert steps == MAX_PREFILL_SKIPS + 48 // 16
    run_until_idle(sched)  # the short ones that piled up meanwhile all finish
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


def test_cdiv_rounds_up():
    assert [cdiv(n, BS) for n in (0, 1, BS - 1, BS, BS + 1, 3 * BS)] == [0, 1, 1, 1, 2, 3]


@pytest.mark.parametrize("order", PREFILL_ORDERS)
def test_a_stream_resumed_from_a_dead_replica_goes_before_the_requests_queued_ahead(order):
    """Its client is mid-stream: it joins at the head of the queue and, under
    ``shortest_first``, goes first although it has more tokens to compute."""
    sched = make_scheduler(budget=40, max_num_seqs=2, prefill_order=order)
    for name in ("a", "b", "c"):
        sched.add(make_request(name, tokens(8)))
    resumed = make_request("resumed", tokens(24), max_tokens=8)
    resumed.resume(tokens(4))  # outputs the dead replica streamed
    sched.add(resumed)
    assert plan(step(sched))[0] == ("resumed", 28)
    assert ids(sched.running)[0] == "resumed"
    run_until_idle(sched)
