"""The host KV tier: blocks move between tiers without loss or duplication, outputs stay bitwise.

The device pool is kept tiny so cached prefixes are evicted to host memory and brought back.
"""

from __future__ import annotations

import random

import pytest

from router.protocol import EventKind, Tier
from tests.worker.helpers import run as run_to_end
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams


def run(engine: LLMEngine, prompts: dict) -> dict:
    return run_to_end(engine, prompts, check_invariants=True)


def tiny(tiny_models, **kw) -> LLMEngine:
    base = dict(
        model=tiny_models["llama"], max_num_batched_tokens=256, device="cpu"
    )  # float32 KV: host_bytes assumes it
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def host_bytes(num_blocks: int) -> int:
    per_block = (
        2 * 2 * 2 * 16 * 32 * 4
    )  # K/V x layers x kv heads x block x head_dim x fp32 (tiny llama)
    return num_blocks * per_block


def test_host_hit_is_bitwise_equal_to_device_hit_and_recompute(tiny_models, test_seed):
    eng = tiny(tiny_models, num_kv_blocks=12, host_kv_cache_bytes=host_bytes(64))
    assert eng.runner.num_host_blocks == 64
    rng = random.Random(test_seed)
    prompt = [rng.randrange(5, 40000) for _ in range(100)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    first = run(eng, {"a": (prompt, params)})["a"]
    device_hit = run(eng, {"b": (prompt, params)})["b"]
    assert device_hit.num_cached_tokens == 96
    filler = {
        f"f{i}": ([rng.randrange(5, 40000) for _ in range(120)], SamplingParams(max_tokens=1))
        for i in range(3)
    }
    run(eng, filler)  # pushes the prompt's blocks out of the 12-block device pool
    hits_before = eng.scheduler.counters.host_cache_hits_tokens
    host_hit = run(eng, {"c": (prompt, params)})["c"]
    assert eng.scheduler.counters.host_cache_hits_tokens - hits_before == 96
    assert host_hit.num_cached_tokens == 96
    recompute = run(
        tiny(tiny_models, num_kv_blocks=64, enable_prefix_caching=False), {"d": (prompt, params)}
    )["d"]
    for other in (device_hit, host_hit, recompute):
        assert other.token_ids == first.token_ids
        assert [lp.logprob for lp in other.outputs[0].logprobs] == [
            lp.logprob for lp in first.outputs[0].logprobs
        ]
    events = [e for b in eng.drain_kv_events() for e in b.events]
    assert any(e.kind == EventKind.STORED and e.tier == Tier.HOST for e in events)
    host_metrics = eng.metrics_snapshot().host
    assert host_metrics.kv_offload_bytes_total > 0 and host_metrics.kv_onload_bytes_total > 0
    assert host_metrics.host_cache_hits_total >= 96
    assert eng.stats().host_to_device_tokens_per_s > 0


def test_random_traffic_across_tiers_keeps_invariants_and_outputs(tiny_models, test_seed):
    eng = tiny(
        tiny_models,
        num_kv_blocks=20,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        host_kv_cache_bytes=host_bytes(24),
    )
    roomy = tiny(tiny_models, num_kv_blocks=1024)
    rng = random.Random(test_seed)
    prefixes = [[rng.randrange(5, 40000) for _ in range(48)] for _ in range(6)]
    prompts = {}
    for i in range(60):
        ids = rng.choice(prefixes)[: rng.choice([16, 32, 48])] + [
            rng.randrange(5, 40000) for _ in range(rng.randint(1, 20))
        ]
        prompts[f"r{i}"] = (
            ids,
            SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True),
        )
    got = {}
    items = list(prompts.items())
    for start in range(0, len(items), 7):  # arrivals in waves, so earlier prefixes get evicted
        got.update(run(eng, dict(items[start : start + 7])))
    ref = run(roomy, prompts)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in ref.items()}
    assert eng.scheduler.counters.host_cache_hits_tokens > 0, (
        "the workload was meant to hit the host tier"
    )
    assert all(b.ref_count == 0 for b in eng.pool.blocks)
    assert eng.pool.host.counters.blocks_saved > 0


def test_host_cache_size_errors(tiny_models):
    with pytest.raises(ValueError, match="host_kv_cache_bytes"):
        EngineConfig(host_kv_cache_bytes=0)
    with pytest.raises(ValueError, match="under one block"):
        tiny(tiny_models, num_kv_blocks=8, host_kv_cache_bytes=10)
