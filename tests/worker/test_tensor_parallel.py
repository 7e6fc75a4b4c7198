"""Tensor parallelism on CPU with gloo: same greedy tokens as one rank, determinism at a fixed
degree, clear errors for sizes that do not divide, and a dead worker that fails loudly.

Every TP engine here starts real worker processes (``LocalProcessLauncher``, about 5 s on
the 2-core CI machine); each test starts only the engines it needs and ends their workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
import torch

from tests.worker.helpers import PROMPTS, engine_prompt_logits, run
from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.outputs import EngineDeadError
from worker.parallel.sharding import ShardPlan, read_spec
from worker.parallel.workers import LocalProcessLauncher, check_local_gpus
from worker.sampling_params import SamplingParams
from worker.testing import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG_PROMPT = "Read the notes and answer.\n" + "".join(
    f"Note {i}: box {i} holds {i * 7} marbles.\n" for i in range(30)
)
# How long a dead worker may take to surface as an error: gloo sees the closed connection at
# once; the bound only keeps a regression from hanging the suite.
DEAD_WORKER_DEADLINE_S = 30.0


def make_engine(model: str, tp: int, **overrides) -> LLMEngine:
    options = dict(
        model=model,
        num_kv_blocks=256,
        max_num_batched_tokens=512,
        tensor_parallel_size=tp,
        device="cpu",  # gloo ranks on this machine's cores, on any machine
    )
    options.update(overrides)
    return LLMEngine(EngineConfig(**options))


@pytest.fixture
def engines():
    """Engines a test starts; their workers end when it does."""
    started: list[LLMEngine] = []

    def start(*args, **kwargs) -> LLMEngine:
        started.append(make_engine(*args, **kwargs))
        return started[-1]

    yield start
    for eng in started:
        eng.shutdown()


def greedy_tokens(
    eng: LLMEngine, prompts: list[str], params: SamplingParams = GREEDY
) -> list[list[int]]:
    done = run(eng, {f"p{i}": (eng.tokenizer.encode(p), params) for i, p in enumerate(prompts)})
    return [done[f"p{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(engines, smollm2_path):
    """The bundled model (9 heads, 3 KV heads, vocabulary 49152) split over three ranks."""
    prompts = PROMPTS[:6]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = greedy_tokens(engines("smollm2", 1), prompts, params)
    three = engines("smollm2", 3)
    assert three.runner.spec.num_heads == 3 and three.runner.spec.num_kv_heads == 1
    assert greedy_tokens(three, prompts, params) == one


@pytest.mark.parametrize(
    "arch,num_kv_heads",
    [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("llama", 1)],
    ids=["llama", "qwen2", "qwen3", "llama-kv-replicated"],
)
def test_tiny_models_tp2_match_tp1(engines, tmp_path, arch, num_kv_heads):
    model = make_tiny_model(tmp_path / arch, arch, seed=3, num_kv_heads=num_kv_heads)
    one, two = engines(model, 1), engines(model, 2)
    assert two.runner.spec.num_kv_heads == (1 if num_kv_heads == 1 else num_kv_heads // 2)
    assert greedy_tokens(two, PROMPTS[:8]) == greedy_tokens(one, PROMPTS[:8])
    ids = one.tokenizer.encode(PROMPTS[8])
    ref = engine_prompt_logits(one, ids)
    ours = engine_prompt_logits(two, ids)
    assert ours.shape == ref.shape == (one.spec.vocab_size,)
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4


def test_determinism_at_tp2(engines, tiny_models):
    """Same tokens alone, after a prefix-cache hit, and in a crowded batch whose step budget
    moves the chunk boundaries and whose KV pool forces preemption and recompute."""
    eng = engines(
        tiny_models["llama"], 2, num_kv_blocks=40, max_num_batched_tokens=64, max_num_seqs=16
    )
    prompt = eng.tokenizer.encode(LONG_PROMPT)
    assert len(prompt) > 4 * 64, "the prompt must be prefilled in several chunks"
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True)
    alone = run(eng, {"alone": (prompt, GREEDY), "alone-seeded": (prompt[-40:], seeded)})
    again = run(eng, {"again": (prompt, GREEDY)})["again"]
    assert again.num_cached_tokens >= len(prompt) - eng.block_size
    rng = random.Random(5)
    crowd = {
        f"other{i}": (
            [rng.randrange(100, 40000) for _ in range(rng.randint(20, 120))],
            SamplingParams(temperature=1.0, max_tokens=rng.randint(4, 24), ignore_eos=True),
        )
        for i in range(14)
    }
    crowd["target"] = (prompt, GREEDY)
    crowd["target-seeded"] = (prompt[-40:], seeded)
    together = run(eng, crowd)
    assert eng.scheduler.counters.num_preemptions > 0, "the KV pool was meant to force preemption"
    expected = alone["alone"].outputs[0].token_ids
    assert again.outputs[0].token_ids == expected
    assert together["target"].outputs[0].token_ids == expected
    assert (
        together["target-seeded"].outputs[0].token_ids == alone["alone-seeded"].outputs[0].token_ids
    )


def test_sizes_that_do_not_divide_are_clear_errors(smollm2_path, tiny_models):
    spec = read_spec(smollm2_path)  # 9 heads, 3 KV heads, intermediate 1536, vocabulary 49152
    with pytest.raises(ValueError, match="does not divide num_heads=9"):
        ShardPlan.make(spec, 0, 2)
    cases = {
        "num_kv_heads=3": dataclasses.replace(
            spec, num_heads=12, num_kv_heads=3
        ),  # 3 KV heads over 4 ranks
        "num_kv_heads=6": dataclasses.replace(
            spec, num_heads=12, num_kv_heads=6
        ),  # 6 KV heads over 4 ranks
        "intermediate_size=1539": dataclasses.replace(
            spec, num_heads=12, num_kv_heads=6, intermediate_size=1539
        ),
        "vocab_size=49153": dataclasses.replace(
            spec, num_heads=12, num_kv_heads=6, vocab_size=49153
        ),
    }
    for name, bad in cases.items():
        with pytest.raises(ValueError, match=name):
            ShardPlan.make(bad, 0, 4 if "kv" in name else 2)
    started = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_heads=9"):
        make_engine("smollm2", 2)
    assert time.monotonic() - started < 20, "the size check must come before any worker starts"
    with pytest.raises(ValueError, match="EngineConfig.tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="EngineConfig.host_kv_cache_bytes"):
        EngineConfig(tensor_parallel_size=2, host_kv_cache_bytes=1 << 20)
    # Local CUDA ranks take cuda:0 .. cuda:N-1 (checked before any worker starts).
    with pytest.raises(ValueError, match="2 local ranks on CUDA need 2 visible GPUs.*sees 1"):
        check_local_gpus(2, visible_gpus=1)
    check_local_gpus(2, visible_gpus=2)


def test_dead_worker_ends_in_flight_requests_with_a_clear_error(tiny_models):
    launcher = LocalProcessLauncher()
    engine = AsyncEngine(
        EngineConfig(
            model=tiny_models["qwen3"],
            num_kv_blocks=256,
            tensor_parallel_size=2,
            max_model_len=1024,
            device="cpu",
        ),
        launcher=launcher,
    )
    long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

    async def scenario() -> tuple[int, BaseException | None]:
        num_outputs, error = 0, None
        try:
            async for _ in engine.generate("long", [5, 6, 7, 8], long):
                num_outputs += 1
                if num_outputs == 3:
                    launcher.kill(1)
        except EngineDeadError as exc:
            error = exc
        return num_outputs, error

    try:
        num_outputs, error = asyncio.run(asyncio.wait_for(scenario(), DEAD_WORKER_DEADLINE_S))
        assert error is not None, (
            f"the request finished ({num_outputs} outputs) although a rank died"
        )
        assert "failed" in str(error)
        assert not engine.is_alive()
        assert "rank(s) [1]" in engine.why_dead()
        with pytest.raises(EngineDeadError, match="rank"):
            asyncio.run(anext(engine.generate("after", [5, 6], SamplingParams(max_tokens=2))))
    finally:
        asyncio.run(engine.shutdown(drain_timeout_s=0))
    assert not torch.distributed.is_initialized(), "no process-wide default group is ever made"
