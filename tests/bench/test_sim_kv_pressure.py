"""The simulator when KV runs out: admission waits for blocks, decodes that outgrow the pool
preempt the newest decoding request, which recomputes and finishes; hand-checked timelines
(times follow from the round rates below) and the pools' books after a pressured run."""

import dataclasses

import pytest

from bench.sim.baselines import RoundRobinPolicy
from bench.sim.calibration import EngineRates
from bench.sim.simulator import SimConfig, Simulator
from bench.sim.workloads import Request, Workload, WorkloadScale, llmd_shared_prefix

RATES = EngineRates(
    prefill_tokens_per_s=100.0,
    decode_step_base_s=0.01,
    decode_step_per_seq_s=0.0,
    max_num_batched_tokens=512,
    host_to_device_tokens_per_s=1000.0,
    source="test",
)


class OneReplica:
    name = "one_replica"

    def choose(self, sim, req):
        return 0


def _run(requests, capacity_blocks):
    config = SimConfig(1, capacity_blocks, block_size=4, rates=RATES, prefill_order="fcfs")
    sim = Simulator(config, OneReplica())
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
    # A: 4 prompt blocks, 21 output tokens (grows to 6 more blocks); B: 4 other blocks, 2
    # output tokens, arrives at 0.01. B fits at 0.16 (A holds 5 of 12) and prefills to 0.33
    # (0.16 s of tokens plus one decode step shared with A). By then A's 18 tokens need 5
    # blocks: 13 > 12, so B, the newest, is preempted right after its first token, and A's
    # growth evicts one of B's freed blocks (the tail: released last to first). B waits for
    # A's end (0.36) and recomputes its last prompt block and its output token (5 tokens,
    # 0.05 s); its one token left came with that step.
    a = _req(0, 0.0, (1, 2, 3, 4), 21)
    b = _req(1, 0.01, (5, 6, 7, 8), 2)
    sim, result, records = _run([a, b], capacity_blocks=12)
    assert sim.num_preemptions == 1 and result.num_preemptions == 1
    assert records[1].ttft_s == pytest.approx(0.32)  # its first prefill's, as the engine's
    assert records[1].num_cached_tokens == 0
    assert records[0].finish_s == pytest.approx(0.36)
    assert records[1].finish_s == pytest.approx(0.41)
    pool = sim.replicas[0].cache
    assert not pool.pinned and pool.num_reserved_blocks == 0 and pool.num_overflow_blocks == 0


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
