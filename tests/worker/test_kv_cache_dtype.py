"""The engine with an 8-bit KV cache (``--kv-cache-dtype``): sizing, determinism in every
situation the full-precision cache guarantees it (prefix cache on and off, batching, chunked
prefill, preemption, the host tier, a resumed stream), and KV transfer kept to engines of
one precision."""

from __future__ import annotations

import random

import pytest

from router.protocol import cache_namespace, hash_blocks
from tests.worker.helpers import run
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.kv_transfer import KVPayloadMismatchError
from worker.sampling_params import SamplingParams

QUANTIZED = ["int8", "fp8_e4m3"]
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 32, 16
"""The tiny llama's shape (``worker/testing.py``)."""


def tiny(tiny_models, kv_cache_dtype: str, **kw) -> LLMEngine:
    options = dict(
        model=tiny_models["llama"],
        device="cpu",
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=128,
        max_num_batched_tokens=256,
    )
    options.update(kw)
    return LLMEngine(EngineConfig(**options))


def tokens_and_logprobs(out) -> list:
    return [(c.token_ids, [lp.logprob for lp in c.logprobs or ()]) for c in out.outputs]


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_same_bytes_hold_about_four_times_the_blocks_of_float32(tiny_models, name):
    budget = 1 << 20
    full = tiny(tiny_models, "auto", num_kv_blocks=None, kv_cache_bytes=budget)
    small = tiny(tiny_models, name, num_kv_blocks=None, kv_cache_bytes=budget)
    full_row, small_row = HEAD_DIM * 4, HEAD_DIM + 2  # bytes of one token's row of one head
    per_block = 2 * LAYERS * KV_HEADS * BLOCK
    assert small.runner.bytes_per_block == per_block * small_row
    assert full.pool.num_blocks == budget // (per_block * full_row)
    assert small.pool.num_blocks == budget // (per_block * small_row)
    assert small.pool.num_blocks / full.pool.num_blocks >= 3.7  # 128/34 at head_dim 32
    assert small.runner.kv.dtype.itemsize == 1
    assert small.stats().kv_cache_dtype == name and full.stats().kv_cache_dtype == "float32"


@pytest.mark.parametrize("name", QUANTIZED)
def test_outputs_do_not_depend_on_cache_batch_chunking_or_preemption(tiny_models, name, test_seed):
    """Each request alone on a fresh engine without prefix caching is the yardstick; the
    same requests together (shared prefixes, 48-token steps, a pool small enough to
    preempt), and again once their prefixes are cached, give its tokens and logprobs
    bitwise."""
    rng = random.Random(test_seed)
    shared = [rng.randrange(5, 40000) for _ in range(70)]
    prompts = {  # shared prefixes of several lengths, and prompts of their own
        f"r{i}": shared[: rng.randint(20, 70)] + [rng.randrange(5, 40000) for _ in range(i % 5)]
        for i in range(6)
    }
    prompts.update({f"o{i}": [rng.randrange(5, 40000) for _ in range(40)] for i in range(6)})
    params = {
        rid: SamplingParams(
            temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=24, ignore_eos=True, logprobs=2
        )
        for i, rid in enumerate(prompts)
    }
    alone = {}
    for rid, ids in prompts.items():
        engine = tiny(tiny_models, name, enable_prefix_caching=False)
        alone[rid] = tokens_and_logprobs(run(engine, {rid: (ids, params[rid])})[rid])
    # 8 running requests of up to 4-6 blocks each in 16 blocks: some are preempted.
    busy = tiny(tiny_models, name, num_kv_blocks=16, max_num_batched_tokens=48, max_num_seqs=8)
    together = run(busy, {rid: (ids, params[rid]) for rid, ids in prompts.items()})
    assert busy.scheduler.counters.num_preemptions > 0, "the pool was meant to preempt"
    again = run(busy, {f"{rid}+": (ids, params[rid]) for rid, ids in prompts.items()})
    assert sum(out.num_cached_tokens for out in again.values()) > 0
    for rid in prompts:
        assert tokens_and_logprobs(together[rid]) == alone[rid], rid
        assert tokens_and_logprobs(again[f"{rid}+"]) == alone[rid], rid


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_host_tier_round_trip_and_a_resumed_stream_keep_the_tokens(tiny_models, name):
    host_bytes = 64 * 2 * LAYERS * KV_HEADS * BLOCK * (HEAD_DIM + 2)
    engine = tiny(tiny_models, name, num_kv_blocks=12, host_kv_cache_bytes=host_bytes)
    assert engine.runner.num_host_blocks == 64
    prompt = list(range(1000, 1100))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    first = run(engine, {"a": (prompt, params)})["a"]
    filler = {f"f{i}": (list(range(2000 + 200 * i, 2120 + 200 * i)), params) for i in range(3)}
    run(engine, filler)  # pushes the prompt's blocks out of the 12-block device pool
    hits_before = engine.scheduler.counters.host_cache_hits_tokens
    host_hit = run(engine, {"b": (prompt, params)})["b"]
    assert engine.scheduler.counters.host_cache_hits_tokens - hits_before == 96
    assert tokens_and_logprobs(host_hit) == tokens_and_logprobs(first)
    cut = 4
    engine.add_request("c", prompt, params, resume_token_ids=first.token_ids[:cut])
    resumed = run(engine)["c"]
    assert resumed.token_ids == first.token_ids


@pytest.mark.parametrize("name", QUANTIZED)
def test_kv_moves_only_between_engines_of_one_precision(tiny_models, name):
    holder = tiny(tiny_models, name)
    prompt = list(range(300, 396))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = run(holder, {"a": (prompt, params)})["a"]
    hashes = hash_blocks(prompt, BLOCK, holder.cache_namespace)
    assert hashes != hash_blocks(prompt, BLOCK, holder.model_id), "8-bit blocks hash apart"
    assert holder.cache_namespace == cache_namespace(holder.model_id, name)
    payload = holder.export_prefix(hashes, prompt)
    assert payload is not None and payload.num_blocks == 6 and payload.dtype == name
    assert payload.kv_bytes == 6 * BLOCK * 2 * LAYERS * KV_HEADS * (HEAD_DIM + 2)
    peer = tiny(tiny_models, name)
    assert peer.import_prefix(payload) == 6
    got = run(peer, {"b": (prompt, params)})["b"]
    assert got.num_cached_tokens == 80 and got.token_ids == want.token_ids  # the last block reruns
    for other in ("auto", *(q for q in QUANTIZED if q != name)):
        with pytest.raises(KVPayloadMismatchError, match=f"payload.dtype: '{name}'"):
            tiny(tiny_models, other).import_prefix(payload)


def test_the_simulated_engine_refuses_an_8bit_cache():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(engine="sim", kv_cache_dtype="int8")


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
