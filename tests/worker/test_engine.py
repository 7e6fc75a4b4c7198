"""Engine behaviour users see: prefix-cache hits, collisions, bad input, sampling options."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

import router.protocol
from tests.worker.helpers import run
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.outputs import FinishReason, OutputDelta, RequestOutput, accumulate
from worker.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_engine(tiny_models):
    return LLMEngine(
        EngineConfig(model=tiny_models["llama"], num_kv_blocks=256, max_num_batched_tokens=256)
    )


@pytest.fixture(scope="module")
def smol_engine(smollm2_path):
    return LLMEngine(EngineConfig(model="smollm2", num_kv_blocks=512, max_num_batched_tokens=512))


def test_the_stats_say_how_many_blocks_and_how_long_a_request_decodes(tiny_models):
    """``num_kv_blocks`` is the pool; ``decode_s`` is 0 until a request finished, then the time
    from its first token to its finish (measured around the run here), a moving average."""
    engine = LLMEngine(EngineConfig(model=tiny_models["llama"], num_kv_blocks=96))
    assert (engine.stats().num_kv_blocks, engine.stats().decode_s) == (96, 0.0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    started = time.monotonic()
    run(engine, {"a": ([1, 2, 3, 4], params)})
    elapsed_s = time.monotonic() - started
    assert 0.0 < engine.stats().decode_s < elapsed_s
    first_s = engine.stats().decode_s
    run(engine, {"b": ([5, 6, 7], dataclasses.replace(params, max_tokens=1))})
    assert engine.stats().decode_s == pytest.approx(0.8 * first_s)  # a 1-token request: 0 s


@pytest.mark.slow
def test_shared_system_prompt_is_served_from_cache(smol_engine):
    tok = smol_engine.tokenizer
    system = " ".join(f"Rule {i}: be precise and kind." for i in range(60))
    sys_ids = tok.encode(system)[:400]
    assert len(sys_ids) == 400
    greedy = SamplingParams(temperature=0, max_tokens=4)
    smol_engine.add_request("first", sys_ids + tok.encode(" Question: what is 2+2?"), greedy)
    first = run(smol_engine)["first"]
    smol_engine.add_request("second", sys_ids + tok.encode(" Question: name a color."), greedy)
    second = run(smol_engine)["second"]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 384


def test_hash_collision_is_caught_not_served(tiny_models, monkeypatch):
    engine = LLMEngine(EngineConfig(model=tiny_models["llama"], num_kv_blocks=64))
    # Every block of every prompt gets the same hash: a total collision.
    monkeypatch.setattr(
        "worker.request.hash_blocks",
        lambda toks, bs, *a, **k: [b"\x00" * 16] * (len(toks) // bs - k.get("start_block", 0)),
    )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a_ids, b_ids = list(range(100, 148)), list(range(300, 348))
    engine.add_request("a", a_ids, greedy)
    run(engine)
    engine.add_request("b", b_ids, greedy)
    b = run(engine)["b"]
    assert b.num_cached_tokens == 0, "a block with other tokens must never be served"
    assert engine.pool.num_collisions >= 1
    monkeypatch.setattr("worker.request.hash_blocks", router.protocol.hash_blocks)
    fresh = LLMEngine(EngineConfig(model=tiny_models["llama"], num_kv_blocks=64))
    fresh.add_request("b", b_ids, greedy)
    assert run(fresh)["b"].token_ids == b.token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "empty"),
        ([1] * 2000, SamplingParams(max_tokens=4), "context"),
        ([1, 2, 3], SamplingParams(max_tokens=5000), "max_tokens"),
        ([1, 2, 10**6], SamplingParams(), "vocabulary"),
        ([1, -5], SamplingParams(), "vocabulary"),
    ],
)
def test_bad_input_is_rejected_and_others_keep_running(tiny_engine, prompt, params, match):
    ok = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tiny_engine.add_request(f"ok-{match}", [5, 6, 7, 8], ok)
    tiny_engine.step()
    with pytest.raises(ValueError, match=match):
        tiny_engine.add_request(f"bad-{match}", prompt, params)
    out = run(tiny_engine)[f"ok-{match}"]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("n", 0),
        ("n", 99),
        ("logprobs", 21),
        ("repetition_penalty", 0.0),
        ("stop", ["x"] * 17),
        ("seed", "abc"),
    ],
)
def test_out_of_range_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_engine_config_errors_name_the_field():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=7)
    with pytest.raises(ValueError, match="only one of"):
        EngineConfig(num_kv_blocks=10, kv_cache_bytes=1000)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")


def test_stop_strings_tokens_and_lengths(tiny_engine):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tiny_engine.add_request("free", [11, 12, 13], base)
    free = run(tiny_engine)["free"].outputs[0]
    assert free.finish_reason == FinishReason.LENGTH and len(free.token_ids) == 24
    # A stop string taken from the middle of the free-running text: output ends right before it.
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        tiny_engine.add_request(
            "stop",
            [11, 12, 13],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        )
        out = run(tiny_engine)["stop"].outputs[0]
        assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop
        assert out.text == text[: text.index(stop)]
    tok = free.token_ids[5]
    tiny_engine.add_request(
        "stoptok",
        [11, 12, 13],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[tok]),
    )
    out = run(tiny_engine)["stoptok"].outputs[0]
    assert (
        out.token_ids == free.token_ids[: free.token_ids.index(tok) + 1] and out.stop_reason == tok
    )
    tiny_engine.add_request(
        "min",
        [11, 12, 13],
        SamplingParams(
            temperature=0,
            max_tokens=24,
            min_tokens=10,
            stop_token_ids=[free.token_ids[0]],
            ignore_eos=True,
        ),
    )
    assert len(run(tiny_engine)["min"].token_ids) >= 10


def test_n_outputs_share_the_prompt_blocks_and_logprobs(tiny_engine):
    prompt = list(range(1000, 1100))
    tiny_engine.add_request(
        "n3",
        prompt,
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=5, ignore_eos=True),
    )
    out = run(tiny_engine)["n3"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "independent samples should differ"
    hits_before = tiny_engine.scheduler.counters.prefix_cache_hits_tokens
    assert hits_before >= 2 * 96, "siblings reuse the prompt's full blocks"
    lp = out.outputs[0].logprobs
    assert len(lp) == 8 and all(len(t.top) == 5 for t in lp)
    assert all(t.top[0][1] >= t.top[-1][1] and t.logprob <= 0 for t in lp)


def test_penalties_change_greedy_output(tiny_engine):
    prompt = [7] * 20
    tiny_engine.add_request(
        "plain", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    tiny_engine.add_request(
        "pen",
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=16,
            ignore_eos=True,
            repetition_penalty=1.9,
            frequency_penalty=2.0,
        ),
    )
    done = run(tiny_engine)
    plain, pen = done["plain"].token_ids, done["pen"].token_ids
    assert len(set(pen)) >= len(set(plain))
    assert plain != pen


def test_step_deltas_add_up_to_the_cumulative_outputs_of_step(tiny_models):
    """Two identical engines run the same requests, one through ``step`` (cumulative outputs),
    one through ``step_deltas``: every step's deltas say what that step's cumulative outputs
    say is new, a prefill chunk that sampled nothing yields no delta, each choice finishes in
    one delta, and each request's deltas add up (``accumulate``) to its final output exactly:
    chunked prefill, n > 1, logprobs, prompt logprobs, a stop string, a stop token, aborts."""
    config = EngineConfig(model=tiny_models["llama"], num_kv_blocks=256, max_num_batched_tokens=64)
    cumulative, streaming = LLMEngine(config), LLMEngine(config)
    prompts: dict[str, list[int]] = {}
    deltas: dict[str, list[OutputDelta]] = {}
    final: dict[str, RequestOutput] = {}
    skipped: set[str] = set()  # requests a step touched without sampling a token

    def add(rid: str, prompt: list[int], params: SamplingParams) -> None:
        prompts[rid] = prompt
        for engine in (cumulative, streaming):
            engine.add_request(rid, prompt, params)

    def step() -> None:
        outs = {o.request_id: o for o in cumulative.step()}
        step_deltas = streaming.step_deltas()
        advanced = {
            rid for rid, o in outs.items() if o.finished or any(c.new_token_ids for c in o.outputs)
        }
        assert sorted(d.request_id for d in step_deltas) == sorted(advanced)
        skipped.update(outs.keys() - advanced)
        for d in step_deltas:
            out = outs[d.request_id]
            assert d.finished == out.finished and d.error == out.error is None
            assert d.num_prompt_tokens == len(out.prompt_token_ids)
            assert d.num_cached_tokens == out.num_cached_tokens
            assert [c.index for c in d.choices] == sorted({c.index for c in d.choices})
            by_index = {c.index: c for c in d.choices}
            for c in out.outputs:
                choice = by_index.pop(c.index, None)
                if choice is None:  # not advanced by this step
                    assert (c.new_token_ids, c.new_text) == ([], "")
                    continue
                assert (choice.new_token_ids, choice.new_text) == (c.new_token_ids, c.new_text)
                assert (choice.finish_reason, choice.stop_reason) == (
                    c.finish_reason,
                    c.stop_reason,
                )
                assert choice.text == (c.text if c.finished else None)
                if c.logprobs is None:
                    assert choice.new_logprobs is None
                else:
                    assert (
                        choice.new_logprobs == c.logprobs[len(c.logprobs) - len(c.new_token_ids) :]
                    )
            assert not by_index, "a delta for a choice the cumulative output does not have"
            deltas.setdefault(d.request_id, []).append(d)
        final.update((rid, o) for rid, o in outs.items() if o.finished)
        assert cumulative.has_unfinished() == streaming.has_unfinished()

    def abort(rid: str) -> None:
        out, d = cumulative.abort(rid), streaming.abort_delta(rid)
        assert out.finished and d.finished and d.request_id == rid
        final[rid] = out
        deltas.setdefault(rid, []).append(d)

    def check(rid: str) -> None:
        want = final[rid]
        got = accumulate(deltas[rid], prompts[rid])
        assert (got.request_id, got.prompt_token_ids, got.num_cached_tokens) == (
            want.request_id,
            want.prompt_token_ids,
            want.num_cached_tokens,
        )
        assert (got.finished, got.error) == (want.finished, want.error) == (True, None)
        assert got.prompt_logprobs == want.prompt_logprobs
        assert {k: v is None for k, v in got.metrics.items()} == {
            k: v is None for k, v in want.metrics.items()
        }

        def fields(c):
            return c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason

        assert [fields(c) for c in got.outputs] == [fields(c) for c in want.outputs], rid
        finishes = [c.index for d in deltas[rid] for c in d.choices if c.finish_reason is not None]
        assert sorted(finishes) == [c.index for c in want.outputs], "each choice ends once"

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    add("free", [11, 12, 13], greedy)
    while cumulative.has_unfinished():
        step()
    check("free")
    free = final["free"].outputs[0]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, text

    long_prompt = [100 + (7 * i) % 900 for i in range(150)]  # three prefill chunks
    add("chunked", long_prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=3))
    add(
        "n3",
        list(range(1000, 1040)),
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, logprobs=2, ignore_eos=True),
    )
    add("stop", [11, 12, 13], dataclasses.replace(greedy, stop=[stop]))
    add("stoptok", [11, 12, 13], dataclasses.replace(greedy, stop_token_ids=[free.token_ids[5]]))
    add(
        "plp", list(range(500, 530)), SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    )
    add(
        "long",
        [5, 6, 7, 8],
        SamplingParams(temperature=0.8, seed=3, max_tokens=200, logprobs=1, ignore_eos=True),
    )
    add("prefilling", long_prompt[::-1], SamplingParams(temperature=0, max_tokens=8, logprobs=1))
    step()
    assert "prefilling" not in deltas, "the check needs it aborted before its first token"
    abort("prefilling")
    while cumulative.has_unfinished():
        step()
        if "long" not in final and sum(len(d.new_token_ids) for d in deltas.get("long", [])) >= 3:
            abort("long")
    assert set(final) == set(prompts)
    for rid in final:
        check(rid)
    assert skipped, "some step only ran a prefill chunk of a request"
    assert [c.finish_reason for c in final["long"].outputs] == [FinishReason.ABORT]
    assert final["prefilling"].outputs[0].token_ids == []
    assert final["stop"].outputs[0].stop_reason == stop
    assert final["stoptok"].outputs[0].stop_reason == free.token_ids[5]
    assert final["plp"].prompt_logprobs is not None
    assert len(final["n3"].outputs) == 3


@pytest.mark.parametrize("spawn", [True, False], ids=["engine-process", "engine-thread"])
def test_async_engine_streams_and_aborts(tiny_models, spawn):
    from worker.async_engine import AsyncEngine

    config = EngineConfig(model=tiny_models["llama"], num_kv_blocks=128)
    engine = AsyncEngine(config, spawn=spawn)
    offline = LLMEngine(config)

    async def main():
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        sent_at_s = time.time()
        chunks = [o async for o in engine.generate("a", [1, 2, 3, 4], params)]
        streamed = accumulate(chunks, [1, 2, 3, 4])
        assert chunks[-1].finished and len(streamed.token_ids) == 12
        # The routing stats say when they were taken: a step that began after the request.
        assert sent_at_s <= engine.stats().as_of_s <= time.time()
        expected = run(offline, {"a": ([1, 2, 3, 4], params)})["a"]
        assert streamed.token_ids == expected.token_ids and streamed.text == expected.text
        assert [lp.token_id for lp in streamed.outputs[0].logprobs] == expected.token_ids
        slow = []  # a reader slower than the engine gets what piled up, merged, nothing lost
        async for out in engine.generate("slow", [1, 2, 3, 4], params):
            slow.append(out)
            await asyncio.sleep(0.05)
        assert [t for o in slow for t in o.new_token_ids] == expected.token_ids
        assert "".join(c.new_text for o in slow for c in o.choices) == expected.text
        slow_logprobs = accumulate(slow, [1, 2, 3, 4]).outputs[0].logprobs
        assert [lp.token_id for lp in slow_logprobs] == expected.token_ids
        assert sum(len(c.new_token_ids) for c in chunks) == 12
        assert "".join(c.new_text for o in chunks for c in o.choices) == streamed.text
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        agen = engine.generate("b", [1, 2, 3, 4], long)
        await agen.__anext__()
        await agen.aclose()  # the client went away
        for _ in range(100):
            if engine.metrics()["num_requests_running"] == 0:
                break
            await asyncio.sleep(0.02)
        m = engine.metrics()
        assert m["num_requests_running"] == 0 and m["num_free_blocks"] == m["num_total_blocks"]
        with pytest.raises(ValueError):
            async for _ in engine.generate("c", [], params):
                pass
        await engine.shutdown(1.0)

    asyncio.run(main())
    assert not engine.is_alive()


def test_engine_process_death_ends_streams_and_health(tiny_models):
    """A killed engine process fails the streams in flight and the health check, at once."""
    import os
    import signal

    from worker.async_engine import AsyncEngine
    from worker.outputs import EngineDeadError

    engine = AsyncEngine(EngineConfig(model=tiny_models["llama"], num_kv_blocks=128), spawn=True)

    async def main():
        stream = engine.generate("long", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine._core._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            async for _ in stream:
                pass
        assert not engine.is_alive() and "code -9" in engine.why_dead()
        with pytest.raises(EngineDeadError):
            await engine.generate("after", [1, 2], SamplingParams(max_tokens=2)).__anext__()

    asyncio.run(main())
