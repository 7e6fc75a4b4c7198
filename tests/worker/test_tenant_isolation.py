"""Tenants that set different ``cache_salt`` never share KV blocks, and ``cached_tokens``
cannot reveal another tenant's prefix (the side channel: send a guess of someone's prompt and
read how much of it was cached)."""

from __future__ import annotations

import pytest

from tests.worker.helpers import run
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLMEngine(
        EngineConfig(model=tiny_models["llama"], num_kv_blocks=128, max_num_batched_tokens=256)
    )


def cached(engine: LLMEngine, rid: str, prompt: list[int], salt: str | None) -> int:
    engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
    return run(engine)[rid].num_cached_tokens


def test_another_salt_sees_nothing_of_a_cached_prompt(engine):
    secret = engine.tokenizer.encode(
        "Tenant A's confidential system prompt: " + "lorem ipsum " * 20
    )
    assert len(secret) >= 4 * engine.block_size
    assert cached(engine, "a1", secret, "tenant-a") == 0
    assert cached(engine, "b1", secret, "tenant-b") == 0, "salt B learnt that A sent this prompt"
    assert cached(engine, "none", secret, None) == 0, "no salt learnt that A sent this prompt"
    assert cached(engine, "a2", secret, "tenant-a") > 0, "the same tenant should hit its own cache"


def test_salted_and_unsalted_requests_hold_disjoint_blocks(engine):
    prompt = engine.tokenizer.encode("Shared words, separate caches: " + "dolor sit amet " * 12)
    for rid, salt in (("x", "tenant-x"), ("y", "tenant-y"), ("plain", None)):
        engine.add_request(
            rid, prompt, SamplingParams(temperature=0, max_tokens=1), cache_salt=salt
        )
    batch = engine.scheduler.schedule()
    assert sorted(r.request_id for r in batch.requests) == [
        "plain",
        "x",
        "y",
    ]  # no dedup across salts
    blocks = {r.request_id: {b.block_id for b in r.blocks} for r in batch.requests}
    engine.scheduler.commit_computed(batch)
    for req in list(batch.requests):
        engine.abort(req.request_id)
    ids = list(blocks.values())
    assert len(ids) == 3 and all(a.isdisjoint(b) for i, a in enumerate(ids) for b in ids[i + 1 :])
