"""Randomized stress: thousands of steps, random arrivals, aborts and lengths, a tiny KV pool.

Checks after every step that no block leaks or is freed twice (``BlockPool.check_invariants``),
at the end that every reference count is back to zero and every request finished or was
aborted, and that every completed greedy output equals the one of an unconstrained run.
"""

from __future__ import annotations

import random

import pytest

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.outputs import FinishReason
from worker.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engines(tiny_models):
    tight = LLMEngine(
        EngineConfig(
            model=tiny_models["llama"],
            num_kv_blocks=24,
            block_size=16,
            max_num_seqs=6,
            max_num_batched_tokens=48,
        )
    )
    roomy = LLMEngine(
        EngineConfig(model=tiny_models["llama"], num_kv_blocks=2048, max_num_batched_tokens=2048)
    )
    return tight, roomy


def test_random_load_with_eviction_and_preemption(engines, test_seed):
    tight, roomy = engines
    rng = random.Random(test_seed)
    shared = [rng.randrange(5, 40000) for _ in range(40)]
    specs, aborted, finished, live = {}, set(), {}, set()
    steps, next_id = 0, 0
    while (next_id < 120 or live) and steps < 6000:
        if next_id < 120 and rng.random() < 0.35:
            prefix = shared[: rng.choice([0, 16, 32, 40])]
            prompt = prefix + [rng.randrange(5, 40000) for _ in range(rng.randint(1, 90))]
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True)
            rid = f"r{next_id}"
            next_id += 1
            specs[rid] = (prompt, params)
            tight.add_request(rid, prompt, params)
            live.add(rid)
        if live and rng.random() < 0.03:
            victim = rng.choice(sorted(live))
            tight.abort(victim)
            live.discard(victim)
            aborted.add(victim)
        for out in tight.step():
            if out.finished:
                live.discard(out.request_id)
                if out.outputs[0].finish_reason != FinishReason.ABORT:
                    finished[out.request_id] = out.token_ids
        tight.scheduler.check_invariants()
        steps += 1
    assert not live and not tight.has_unfinished(), (
        f"seed {test_seed}: requests left after {steps} steps"
    )
    assert set(finished) | aborted == set(specs)
    assert all(b.ref_count == 0 for b in tight.pool.blocks), f"seed {test_seed}: leaked references"
    assert tight.pool.num_free_blocks == tight.pool.num_blocks
    assert tight.scheduler.counters.num_preemptions > 0, "the pool was meant to force preemption"
    for rid in finished:
        roomy.add_request(rid, *specs[rid])
    reference = {}
    while roomy.has_unfinished():
        for out in roomy.step():
            if out.finished:
                reference[out.request_id] = out.token_ids
    diff = [rid for rid in finished if finished[rid] != reference[rid]]
    assert not diff, f"seed {test_seed}: outputs differ from an unconstrained run for {diff[:5]}"
