"""The simulated engine (``engine="sim"``): the real engine around a timing model.

On the same schedule it reports what the real engine reports (stats, KV events, cached
tokens, preemptions); its tokens depend on the prompt and the position only, so batching,
cache hits and a stream resumed on another engine change nothing; its KV moves between sim
engines and is refused from a real one; its steps take the time the profile says.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest

from router.protocol import hash_blocks
from tests.worker.helpers import run
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.kv_transfer import KVPayloadMismatchError
from worker.sampling_params import SamplingParams
from worker.sim_model import load_profile, preset_names

BLOCK = 16


def engine(tiny_models, **kw) -> LLMEngine:
    base = dict(
        model=tiny_models["llama"],
        device="cpu",
        num_kv_blocks=12,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        engine="sim",
        sim_profile="gpu",
    )
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


TAIL_BLOCKS = (3, 1, 2, 3, 3, 2, 1, 3, 2, 3)
"""Each request's own blocks. The schedule depends on the lengths alone (hits come from the
shared prefix, whatever its tokens), and these overflow the 12 blocks for any seed: random
lengths left 2 seeds in 300 without a preemption."""


def prompts(rng: random.Random) -> dict:
    """Requests that share prefixes (hits), run in chunks and overflow the 12 blocks
    (preemption). Outputs stay under a block, so every full block holds prompt tokens and the
    two engines' block hashes agree."""
    shared = [rng.randrange(5, 40000) for _ in range(2 * BLOCK)]
    out = {}
    for i, num_blocks in enumerate(TAIL_BLOCKS):
        tail = [rng.randrange(5, 40000) for _ in range(BLOCK * num_blocks)]
        params = SamplingParams(temperature=0, max_tokens=BLOCK - 1, ignore_eos=True)
        out[f"r{i}"] = ((shared if i % 2 else []) + tail, params)
    return out


def test_same_schedule_same_stats_and_kv_events_as_the_real_engine(tiny_models, test_seed):
    work = prompts(random.Random(test_seed))
    real, sim = engine(tiny_models, engine="model"), engine(tiny_models)
    for e in (real, sim):
        for rid, (ids, params) in work.items():
            e.add_request(rid, ids, params)
    cached: dict[str, dict[str, int]] = {"model": {}, "sim": {}}
    while real.has_unfinished() or sim.has_unfinished():
        for e in (real, sim):
            for out in e.step():
                if out.finished:
                    cached[e.config.engine][out.request_id] = out.num_cached_tokens
            e.pool.check_invariants()
        measured = dict(prefill_tokens_per_s=0, decode_tokens_per_s=0, decode_s=0)  # timings
        assert dataclasses.replace(sim.stats(), **measured) == dataclasses.replace(
            real.stats(), **measured
        )
        assert (sim.stats().decode_s > 0) == (real.stats().decode_s > 0)
        assert [b.events for b in sim.drain_kv_events()] == [
            b.events for b in real.drain_kv_events()
        ]
    assert cached["sim"] == cached["model"] and len(cached["sim"]) == len(work)
    assert sum(cached["sim"].values()) > 0
    assert sim.scheduler.counters == real.scheduler.counters
    assert sim.scheduler.counters.num_preemptions > 0


def test_tokens_do_not_depend_on_batch_cache_or_replica(tiny_models, test_seed):
    rng = random.Random(test_seed)
    prompt = [rng.randrange(5, 40000) for _ in range(40)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    a = engine(tiny_models)
    alone = run(a, {"g": (prompt, greedy), "s": (prompt, sampled)})
    crowd = {f"x{i}": ([rng.randrange(5, 40000) for _ in range(30)], greedy) for i in range(5)}
    batched = run(a, {"g": (prompt, greedy), "s": (prompt, sampled), **crowd})  # cache hits now
    assert batched["g"].num_cached_tokens > 0
    for rid in ("g", "s"):
        assert batched[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids
    assert alone["g"].outputs[0].token_ids != alone["s"].outputs[0].token_ids
    assert len(set(alone["g"].outputs[0].token_ids)) > 10  # not one token over and over

    b = engine(tiny_models)  # another replica resumes after 7 streamed tokens
    for rid, params in (("g", greedy), ("s", sampled)):
        done = alone[rid].outputs[0].token_ids
        b.add_request(rid, prompt, params, resume_token_ids=done[:7])
        resumed = run(b)[rid].outputs[0].token_ids
        assert resumed == done


def test_kv_moves_between_sim_engines_and_not_from_a_real_one(tiny_models, test_seed):
    rng = random.Random(test_seed)
    prompt = [rng.randrange(5, 40000) for _ in range(3 * BLOCK + 5)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    holder, puller = engine(tiny_models), engine(tiny_models)
    want = run(holder, {"a": (prompt, params)})["a"]
    hashes = hash_blocks(prompt, BLOCK, holder.model_id)
    payload = holder.export_prefix(hashes, prompt)
    assert payload.num_blocks == 3
    assert payload.kv[:, 0, 0].flatten().tolist() == prompt[: 3 * BLOCK]  # K holds the tokens
    assert puller.import_prefix(payload) == 3
    got = run(puller, {"b": (prompt, params)})["b"]
    assert got.num_cached_tokens == 3 * BLOCK
    assert got.outputs[0].token_ids == want.outputs[0].token_ids

    real = engine(tiny_models, engine="model")
    run(real, {"a": (prompt, params)})
    with pytest.raises(KVPayloadMismatchError, match="num_layers"):
        puller.import_prefix(real.export_prefix(hashes, prompt))


def test_logprobs_and_prompt_logprobs_come_from_the_certain_model(tiny_models, test_seed):
    rng = random.Random(test_seed)
    prompt = [rng.randrange(5, 40000) for _ in range(20)]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    scored = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    e = engine(tiny_models)
    out = run(e, {"p": (prompt, plain), "l": (prompt, scored)})
    assert out["l"].outputs[0].token_ids == out["p"].outputs[0].token_ids
    for entry, token in zip(
        out["l"].outputs[0].logprobs, out["l"].outputs[0].token_ids, strict=True
    ):
        assert entry.token_id == token and entry.top[0][0] == token
        assert entry.logprob == pytest.approx(0.0, abs=1e-6)
    assert len(out["l"].prompt_logprobs) == len(prompt)


def test_a_step_takes_the_profiles_time(tiny_models, tmp_path):
    profile = {**dataclasses.asdict(load_profile("gpu")), "decode_step_base_s": 0.05}
    profile.pop("name")
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    e = engine(tiny_models, sim_profile=str(path))
    e.add_request("a", [5] * 10, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    e.step()  # the prefill: 10 tokens at 40k tokens/s
    start_s = time.perf_counter()
    e.step()  # one decode step
    assert time.perf_counter() - start_s >= 0.05
    e.runner.waits_for_device = False  # host work alone (bench/engine_host.py)
    start_s = time.perf_counter()
    e.step()
    assert time.perf_counter() - start_s < 0.05


def test_profiles_are_checked():
    assert {"cpu", "gpu"} <= set(preset_names())
    gpu = load_profile("gpu")
    assert 15_000 < gpu.decode_tokens_per_s(256, 160) < 25_000  # the profile's stated figure
    with pytest.raises(ValueError, match="neither a preset"):
        load_profile("no-such-profile")
    with pytest.raises(ValueError, match="engine"):
        EngineConfig(engine="sim", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="memory fraction"):
        EngineConfig(engine="sim", kv_cache_memory_fraction=0.5)
    with pytest.raises(ValueError, match="engine"):
        EngineConfig(engine="fake")


def test_the_host_tier_keeps_evicted_prefixes(tiny_models, test_seed):
    """Blocks evicted from the device go to the host tier and come back on a hit, with the
    simulated model's bytes sizing it; tokens are those of a cold run."""
    rng = random.Random(test_seed)
    first = [rng.randrange(5, 40000) for _ in range(4 * BLOCK)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    block_bytes = load_profile("gpu").kv_bytes_per_token * BLOCK
    e = engine(tiny_models, num_kv_blocks=8, host_kv_cache_bytes=16 * block_bytes)
    assert e.runner.num_host_blocks == 16
    cold = run(e, {"a": (first, params)})["a"]
    for i in range(3):  # other prompts push the first one's blocks out of the device
        run(e, {f"x{i}": ([rng.randrange(5, 40000) for _ in range(4 * BLOCK)], params)})
    again = run(e, {"b": (first, params)})["b"]
    assert e.scheduler.counters.host_cache_hits_tokens > 0
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
