"""Determinism on the bundled model: same tokens whatever the cache, batch, chunking, preemption,
with the full-precision KV cache and with each 8-bit one (``--kv-cache-dtype``).

These are the failures users reported on other engines (lmdeploy issue 1719: prefix caching
changed greedy outputs; vLLM: 80 distinct completions out of 1000 identical greedy requests).
"""

from __future__ import annotations

import random

import pytest

from tests.worker.helpers import run
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LONG_PROMPT = (
    "You are a meticulous assistant. Read the following notes and answer briefly.\n"
    + "".join(
        f"Note {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} marbles.\n"
        for i in range(22)
    )
    + "Question: which box holds the most marbles, and how many?"
)


KV_DTYPES = ["auto", "int8", "fp8_e4m3"]


def engine(**overrides) -> LLMEngine:
    options = dict(model="smollm2", num_kv_blocks=512, max_num_batched_tokens=512)
    options.update(overrides)
    return LLMEngine(EngineConfig(**options))


@pytest.fixture(scope="module")
def cached_engine(smollm2_path):
    return engine()


@pytest.fixture(scope="module")
def prompt_ids(cached_engine):
    return cached_engine.tokenizer.encode(LONG_PROMPT)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_lmdeploy_1719_prefix_cache_never_changes_greedy_output(
    cached_engine, prompt_ids, kv_cache_dtype
):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cached = cached_engine if kv_cache_dtype == "auto" else engine(kv_cache_dtype=kv_cache_dtype)
    outs = [run(cached, {f"rep{i}": (prompt_ids, greedy)})[f"rep{i}"] for i in range(3)]
    uncached = run(
        engine(enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype),
        {"off": (prompt_ids, greedy)},
    )["off"]
    assert len(prompt_ids) > 2 * 128, "the prompt must span several attention KV chunks"
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= len(prompt_ids) - 16 for o in outs[1:]), [
        o.num_cached_tokens for o in outs
    ]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids == uncached.token_ids


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_one_distinct_output_under_load_chunking_and_preemption(
    smollm2_path, prompt_ids, test_seed, kv_cache_dtype
):
    # A 48-token step budget forces chunked prefill; 24 blocks for up to 32 running
    # sequences that each grow past a block boundary (40 + 12 tokens) forces preemption.
    eng = engine(
        num_kv_blocks=24, max_num_batched_tokens=48, max_num_seqs=32, kv_cache_dtype=kv_cache_dtype
    )
    rng = random.Random(test_seed)
    question = prompt_ids[-40:]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {f"same{i}": (question, greedy) for i in range(200)}
    vocab = eng.spec.vocab_size
    for i in range(50):
        other = [rng.randrange(100, vocab) for _ in range(rng.randint(5, 120))]
        prompts[f"other{i}"] = (
            other,
            SamplingParams(temperature=0, max_tokens=rng.randint(1, 6), ignore_eos=True),
        )
    order = list(prompts.items())
    rng.shuffle(order)
    done = run(eng, dict(order))
    distinct = {tuple(done[f"same{i}"].token_ids) for i in range(200)}
    assert eng.scheduler.counters.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert len(distinct) == 1, f"{len(distinct)} distinct outputs for 200 identical greedy requests"
    alone = run(engine(kv_cache_dtype=kv_cache_dtype), {"alone": (question, greedy)})["alone"]
    assert distinct == {tuple(alone.token_ids)}


def test_seeded_sampling_same_alone_and_in_batch_of_32(cached_engine, prompt_ids, test_seed):
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    q = prompt_ids[-40:]
    alone = run(cached_engine, {"alone": (q, seeded)})["alone"]
    rng = random.Random(test_seed)
    batch = {
        f"b{i}": (
            [rng.randrange(100, 40000) for _ in range(rng.randint(3, 40))],
            SamplingParams(temperature=1.0, max_tokens=rng.randint(2, 12), ignore_eos=True),
        )
        for i in range(31)
    }
    batch["target"] = (q, seeded)
    together = run(cached_engine, batch)["target"]
    assert together.token_ids == alone.token_ids


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_chunk_sizes_give_identical_outputs(smollm2_path, prompt_ids, kv_cache_dtype):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for budget in (16, 64, 512, 2048):
        eng = engine(
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,
            kv_cache_dtype=kv_cache_dtype,
        )
        results[budget] = run(eng, {"x": (prompt_ids, greedy)})["x"].token_ids
    assert len({tuple(v) for v in results.values()}) == 1, results
