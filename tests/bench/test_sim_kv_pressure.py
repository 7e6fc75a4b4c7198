"""The simulator's decodes and KV: admission waits for a first chunk's blocks, decodes that
outgrow the pool preempt the newest admitted request (a prefill keeps its computed chunks;
a decode recomputes and finishes), a shorter prompt overtakes a long one between its chunks,
and a prefill slows the decodes that share its steps; hand-checked timelines (times follow
from the round rates below) and the pools' books after a pressured run."""

import dataclasses

import pytest

from bench.sim.baselines import RoundRobinPolicy
from bench.sim.simulator import SimConfig, Simulator
from bench.sim.workloads import Request, Workload, WorkloadScale, llmd_shared_prefix
from tests.bench.sim_helpers import HAND_RATES as RATES
from tests.bench.sim_helpers import FirstReplica

CHUNKED_RATES = dataclasses.replace(RATES, max_num_batched_tokens=8)
"""8-token chunks (two blocks of 4), so a prompt takes several steps."""


def _run(requests, capacity_blocks, rates=RATES, prefill_order="fcfs"):
    config = SimConfig(1, capacity_blocks, block_size=4, rates=rates, prefill_order=prefill_order)
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


def test_a_prefill_is_admitted_on_its_first_chunk_and_preempts_itself_when_the_next_is_short():
    # A: 16 prompt tokens in two chunks (0-0.16 s), then 5 output tokens; it holds 5 of the 12
    # blocks. B (32 tokens, 8 blocks, arrives at 0.01) would not fit whole, but its first
    # chunk's 2 blocks do: admitted at 0.16, its chunks share steps with A's decode (0.09 s
    # each: 0.25, 0.34, 0.43). At 0.43 its last chunk needs 2 blocks more than the 1 free:
    # B, the newest, preempts itself; its 24 computed tokens (6 blocks) stay cached. A, alone,
    # ends at 0.44; B is admitted again on its cached 6 blocks and computes only its last 8
    # tokens: first token at 0.52. It reports the hit of its first admission: none.
    a = _req(0, 0.0, (1, 2, 3, 4), 5)
    b = _req(1, 0.01, (5, 6, 7, 8, 9, 10, 11, 12), 2)
    sim, result, records = _run([a, b], capacity_blocks=12, rates=CHUNKED_RATES)
    assert records[0].ttft_s == pytest.approx(0.16)
    assert records[0].finish_s == pytest.approx(0.44)
    assert records[1].ttft_s == pytest.approx(0.51)
    assert records[1].num_cached_tokens == 0
    assert result.num_preemptions == 1 and result.num_kv_waits == 1
    pool = sim.replicas[0].cache
    assert not pool.pinned and pool.num_reserved_blocks == 0 and pool.num_overflow_blocks == 0


def test_a_decode_that_outgrows_the_pool_preempts_a_prefill_admitted_after_it():
    # A: 4-token prompt (0-0.04 s), 12 output tokens, a block per 4 of them. B (39 tokens in
    # 10 blocks, one output token, at 0.01) is admitted at 0.04 on its first chunk; its steps
    # carry A's decode (0.09 s). At 0.40 B has computed 32 tokens and the pool of 10 is full
    # when A's 5th token needs a block: the newest running request, B, is preempted, not A
    # (which the engine admitted first). B's 8 computed blocks are cached, one is evicted for
    # A's block; B's next chunk does not fit beside A's blocks, so it waits for A's end
    # (0.47), then computes its 11 uncached tokens in two chunks: first token at 0.58.
    a = _req(0, 0.0, (1,), 12)
    b = Request(1, 0.01, tuple(range(10, 20)), num_prompt_tokens=39, num_output_tokens=1)
    sim, result, records = _run([a, b], capacity_blocks=10, rates=CHUNKED_RATES)
    assert records[0].ttft_s == pytest.approx(0.04)
    assert records[0].finish_s == pytest.approx(0.47)
    assert records[1].ttft_s == pytest.approx(0.57)
    assert result.num_preemptions == 1 and result.num_kv_waits == 1
    pool = sim.replicas[0].cache
    assert not pool.pinned and pool.num_reserved_blocks == 0 and pool.num_overflow_blocks == 0


def test_a_short_prompt_overtakes_a_long_prefill_at_a_step_boundary():
    # A: 32 cold tokens, four 8-token chunks; B: 8 tokens, arrives at 0.01. Shortest first:
    # after A's first chunk (0.08) B, with fewer tokens left, takes the next step (first
    # token at 0.16), then A's chunks resume (the first sharing its step with B's last
    # decode): A's first token at 0.41. First come, first served: B waits for A's whole
    # prefill (0.32); its one chunk shares a step with A's decode: first token at 0.41.
    a = _req(0, 0.0, tuple(range(1, 9)), 2)
    b = _req(1, 0.01, (20, 21), 2)
    _, _, shortest = _run([a, b], 64, CHUNKED_RATES, "shortest_first")
    assert shortest[1].ttft_s == pytest.approx(0.15)
    assert shortest[0].ttft_s == pytest.approx(0.41)
    _, _, fcfs = _run([a, b], 64, CHUNKED_RATES)
    assert fcfs[0].ttft_s == pytest.approx(0.32)
    assert fcfs[1].ttft_s == pytest.approx(0.40)


def test_a_request_whose_prefix_an_admitted_prefill_computes_waits_for_it():
    # Shortest first, 8-token chunks. A (16 cold tokens) is admitted at 0; B (4 tokens, A's
    # first block) arrives at 0.01. At A's first step boundary B has fewer tokens left (4
    # against 8), but its block is being computed by A: it waits (in-flight dedup) rather
    # than compute a copy. A's last chunk ends at 0.16; B then finds 3 of its 4 tokens cached
    # and computes the last one in a step it shares with A's decode: first token at 0.18.
    a = _req(0, 0.0, (1, 2, 3, 4), 2)
    b = _req(1, 0.01, (1,), 1)
    sim, result, records = _run([a, b], 64, CHUNKED_RATES, "shortest_first")
    assert records[0].ttft_s == pytest.approx(0.16)
    assert records[1].ttft_s == pytest.approx(0.17)
    assert records[1].num_cached_tokens == 3
    assert result.num_dedup_deferrals >= 1
