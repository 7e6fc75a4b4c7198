"""The simulator's decodes and KV: admission waits for blocks, decodes that outgrow the pool
preempt the newest decoding request, which recomputes and finishes, and a prefill slows the
decodes that share its steps; hand-checked timelines (times follow from the round rates
below) and the pools' books after a pressured run."""

import dataclasses

import pytest

from bench.sim.baselines import RoundRobinPolicy
from bench.sim.simulator import SimConfig, Simulator
from bench.sim.workloads import Request, Workload, WorkloadScale, llmd_shared_prefix
from tests.bench.sim_helpers import HAND_RATES as RATES
from tests.bench.sim_helpers import FirstReplica


def _run(requests, capacity_blocks):
    config = SimConfig(1, capacity_blocks, block_size=4, rates=RATES, prefill_order="fcfs")
    sim = Simulator(config, FirstReplica())
    records = []
    original = sim._summarize

    def keep_records(workload, recs, *args):
        records.extend(recs)
        return original(workload, recs, *args)

    sim._summarize = keep_records
    result = sim.run(Workload("hand", tuple(requests), "hand-checked"))
    return sim, result, records


def _req(i, at_s, blocks, output_tokens):
    return Request(
        i, at_s, blocks, num_prompt_tokens=4 * len(blocks), num_output_tokens=output_tokens
    )


def test_a_prefill_that_does_not_fit_waits_for_a_decode_to_end():
    # A: 16 prompt tokens (4 blocks), 21 output tokens: prefill 0-0.16 s, 20 decode steps to
    # 0.36 s. B (32 tokens, 8 blocks) arrives at 0.01; at 0.16 A holds 5 of the 12 blocks, so
    # B does not fit and starts only when A ends: prefill 0.36-0.68 s.
    a = _req(0, 0.0, (1, 2, 3, 4), 21)
    b = _req(1, 0.01, (5, 6, 7, 8, 9, 10, 11, 12), 2)
    sim, result, records = _run([a, b], capacity_blocks=12)
    assert records[0].ttft_s == pytest.approx(0.16)
    assert records[0].finish_s == pytest.approx(0.36)
    assert records[1].ttft_s == pytest.approx(0.67)
    assert sim.num_kv_waits == 1 and result.num_kv_waits == 1
    assert sim.num_preemptions == 0
    assert sim.replicas[0].cache.num_overflow_blocks == 0


def test_a_decode_that_outgrows_the_pool_preempts_the_newest_which_recomputes():
    # A and B: 4 prompt blocks each, 21 output tokens (6 more blocks each); B arrives at 0.01.
    # B fits at 0.16 (A holds 5 of 12) and prefills to 0.33 (0.16 s of tokens plus one
    # decode step shared with A, so A gets one token in that step). Then both decode a token
    # per 0.01 s and their growth outruns the 2 free blocks at 0.40 (A's 9th token): A takes
    # its blocks, B, the newest, is preempted with 8 tokens. It waits for A's end (0.52) and
    # recomputes its last prompt token and its 8 tokens from the prefix cache (0.09 s), then
    # decodes its last 12 tokens: 0.73.
    a = _req(0, 0.0, (1, 2, 3, 4), 21)
    b = _req(1, 0.01, (5, 6, 7, 8), 21)
    sim, result, records = _run([a, b], capacity_blocks=12)
    assert sim.num_preemptions == 1 and result.num_preemptions == 1
    assert records[1].ttft_s == pytest.approx(0.32)  # its first prefill's, as the engine's
    assert records[1].num_cached_tokens == 0
    assert records[0].finish_s == pytest.approx(0.52)
    assert records[1].finish_s == pytest.approx(0.73)
    pool = sim.replicas[0].cache
    assert not pool.pinned and pool.num_reserved_blocks == 0 and pool.num_overflow_blocks == 0


def test_a_prefill_slows_the_decodes_it_shares_its_steps_with():
    # A decodes from 0.16; B's 96-token prefill (one chunk) runs 0.16-1.13 in one step
    # (0.96 s of tokens plus A's decode), so A gets one token in it, then the other 9 at
    # 0.01 s: A ends at 1.22, not at 0.26 as it would alone.
    a = _req(0, 0.0, (1, 2, 3, 4), 11)
    b = _req(1, 0.01, tuple(range(10, 34)), 2)
    sim, _, records = _run([a, b], capacity_blocks=64)
    assert records[1].ttft_s == pytest.approx(1.12)
    assert records[0].finish_s == pytest.approx(1.22)
    _, _, alone_records = _run([a], capacity_blocks=64)
    assert alone_records[0].finish_s == pytest.approx(0.26)


def test_a_pressured_cluster_preempts_and_its_pools_balance_at_the_end():
    scale = WorkloadScale(
        num_replicas=4,
        capacity_blocks=200,
        block_size=16,
        requests_per_replica=12,
        offered_load=0.9,
        prefill_tokens_per_s=RATES.prefill_tokens_per_s,
        seed=3,
    )
    workload = llmd_shared_prefix(scale)  # 1280-token prompts, 180 output tokens: 92 blocks
    slow_decode = dataclasses.replace(RATES, decode_step_base_s=0.2)  # decodes outlast prefills
    config = SimConfig(4, 200, block_size=16, rates=slow_decode, seed=3)
    sim = Simulator(config, RoundRobinPolicy())
    result = sim.run(workload)
    assert result.num_preemptions > 0 and result.num_kv_waits > 0
    assert sum(r.num_served for r in sim.replicas) == len(workload.requests)
    for replica in sim.replicas:
        pool = replica.cache
        assert not replica.decoding and not replica.generated_before and not replica.queue
        assert not pool.pinned and pool.num_reserved_blocks == 0
        assert pool.num_overflow_blocks == 0
        assert len(pool.cached) <= pool.capacity_blocks
