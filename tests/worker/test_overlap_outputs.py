"""The engine loop that launches the next step before it reports this one
(``EngineConfig.overlap_outputs``, ``EngineLoop``).

Overlapping moves when a step's tokens leave, never which tokens: the same requests stream the
same tokens, text, logprobs and finishes with it on and off, stop strings included (whose text
is decoded before the next launch); a request aborted while its step is in flight gets
nothing from that step and its blocks come back; ``auto`` overlaps where a launch returns
before the forward pass ends, and the simulated engine's launch does.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest

from tests.worker.helpers import AUTO_HERE
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.engine_commands import Abort, Add
from worker.engine_core import EngineLoop
from worker.outputs import FinishReason
from worker.sampling_params import SamplingParams
from worker.sim_model import load_profile

BLOCK = 16


def make_engine(tiny_models, engine: str, overlap: str, **kw) -> LLMEngine:
    """A tiny model's engine on this machine's device (CUDA where visible: the GPU check runs
    these tests there), or the simulated engine."""
    config = dict(
        model=tiny_models["llama"],
        device=AUTO_HERE[0] if engine == "model" else "cpu",
        num_kv_blocks=64,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        engine=engine,
        overlap_outputs=overlap,
    )
    config.update(kw)
    return LLMEngine(EngineConfig(**config))


def add(request_id: str, prompt: list[int], params: SamplingParams) -> Add:
    return Add(request_id, prompt, params)


def stream(engine: LLMEngine, arrivals: list[list[Add]]) -> dict[str, dict]:
    """Drives an ``EngineLoop``: before step i it takes ``arrivals[i]``, then steps until
    idle. Per request and choice: the streamed token ids, text, logprobs' tokens and the
    finish, as a server would put them together."""
    loop = EngineLoop(engine)
    got: dict[str, dict] = {}
    step = 0
    while step < len(arrivals) or not loop.idle():
        for command in arrivals[step] if step < len(arrivals) else []:
            loop.handle(command)
        step += 1
        result = loop.step()
        for delta in result.outputs if result else []:
            for choice in delta.choices:
                seen = got.setdefault(
                    f"{delta.request_id}/{choice.index}", {"ids": [], "text": "", "pieces": []}
                )
                seen["ids"] += choice.new_token_ids
                seen["text"] += choice.new_text
                seen["pieces"].append(choice.new_text)
                if choice.new_logprobs:
                    seen.setdefault("logprobs", []).extend(e.token_id for e in choice.new_logprobs)
                if choice.finish_reason is not None:
                    seen["finish"] = (choice.finish_reason, choice.stop_reason, choice.text)
        engine.scheduler.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return got


def workload(rng: random.Random, stop: str | None = None) -> list[list[Add]]:
    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, 40000) for _ in range(n)]

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=9, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2)
    stopping = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[stop] if stop else []
    )
    shared = prompt(20)
    return [
        [add("g", shared + prompt(5), greedy), add("s", prompt(30), sampled)],
        [],
        [add("l", shared + prompt(9), scored), add("t", prompt(11), stopping)],
        [add("late", prompt(40), greedy)],
    ]


@pytest.mark.parametrize("engine_kind", ["sim", "model"])
def test_overlapping_changes_when_tokens_leave_not_which(tiny_models, test_seed, engine_kind):
    plain = stream(make_engine(tiny_models, engine_kind, "off"), workload(random.Random(test_seed)))
    # A stop string that the stopping request's text holds: its text must be decoded before
    # the next step is launched, or the overlapped loop would run past the stop.
    text = plain["t/0"]["text"]
    assert len(text) > 4, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    # The token that completes the stop string ends the request: the first k tokens whose
    # text (one token per step, none held back without stop strings) holds it.
    pieces = plain["t/0"]["pieces"]
    stop_at = next(k for k in range(1, len(pieces) + 1) if stop in "".join(pieces[:k]))
    off = stream(
        make_engine(tiny_models, engine_kind, "off"), workload(random.Random(test_seed), stop)
    )
    on = stream(
        make_engine(tiny_models, engine_kind, "on"), workload(random.Random(test_seed), stop)
    )
    assert on == off
    assert off["t/0"]["finish"][0] is FinishReason.STOP and off["t/0"]["finish"][1] == stop
    assert off["t/0"]["ids"] == plain["t/0"]["ids"][:stop_at]
    assert set(off) == {"g/0", "s/0", "s/1", "l/0", "t/0", "late/0"}
    assert off["l/0"]["logprobs"] == off["l/0"]["ids"]  # greedy: the top entry is the token


def test_a_request_aborted_while_its_step_is_in_flight_gets_nothing_from_it(tiny_models, test_seed):
    rng = random.Random(test_seed)
    engine = make_engine(tiny_models, "sim", "on")
    loop = EngineLoop(engine)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = {rid: [rng.randrange(5, 40000) for _ in range(24)] for rid in ("a", "b")}
    for rid, prompt in prompts.items():
        loop.handle(add(rid, prompt, params))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    aborted = engine._groups["a"][0]
    # Abort while the step in flight fills one of the request's blocks: the step must neither
    # append its token nor cache the block the abort just freed.
    while not (loop._in_flight and (aborted.num_computed_tokens + 1) % BLOCK == 0):
        for delta in getattr(loop.step(), "outputs", []):
            tokens[delta.request_id] += delta.choices[0].new_token_ids
    assert aborted in loop._in_flight.batch.requests and tokens["a"]
    loop.handle(Abort("a"))
    assert engine.scheduler.running == [r for r in engine.scheduler.running if r.request_id == "b"]
    finishes = []
    while not loop.idle():
        result = loop.step()
        for delta in result.outputs if result else []:
            tokens[delta.request_id] += delta.choices[0].new_token_ids
            if delta.finished:
                finishes.append((delta.request_id, delta.choices[0].finish_reason))
        engine.scheduler.check_invariants()
    assert finishes == [("a", FinishReason.ABORT), ("b", FinishReason.LENGTH)]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    alone = make_engine(tiny_models, "sim", "off")
    reference = stream(alone, [[add("b", prompts["b"], params)]])
    assert tokens["b"] == reference["b/0"]["ids"]
    assert aborted.output_token_ids == tokens["a"] and len(tokens["a"]) < 20


def test_auto_overlaps_where_a_launch_returns_before_the_forward_pass(tiny_models):
    assert make_engine(tiny_models, "sim", "auto").overlaps_outputs
    on_cuda = AUTO_HERE[0].startswith("cuda")
    assert make_engine(tiny_models, "model", "auto").overlaps_outputs == on_cuda
    assert make_engine(tiny_models, "model", "on").overlaps_outputs
    assert not make_engine(tiny_models, "sim", "off").overlaps_outputs
    with pytest.raises(ValueError, match="overlap_outputs"):
        EngineConfig(overlap_outputs="yes")


def test_the_simulated_forward_pass_runs_while_the_host_works(tiny_models, tmp_path):
    """A launch returns at once; sampling waits for the profile's step time since the launch,
    so host work between the two is hidden in it, as on a GPU."""
    profile = {**dataclasses.asdict(load_profile("gpu")), "decode_step_base_s": 0.2}
    profile.pop("name")
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    engine = make_engine(tiny_models, "sim", "on", sim_profile=str(path))
    engine.add_request("a", [5] * 10, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.sample_step(engine.launch_step())  # the prefill
    start_s = time.perf_counter()
    launched = engine.launch_step()  # one decode step
    assert time.perf_counter() - start_s < 0.2
    assert launched.logits.ready_at_s >= start_s + 0.2
    engine.sample_step(launched)
    assert time.perf_counter() >= launched.logits.ready_at_s


def test_offline_generate_overlapped_gives_what_it_gives_sequential(tiny_models, test_seed):
    """``LLMEngine.steps`` (``LLM.generate``'s loop) with the next step launched before each
    step's outputs are built: the same finished outputs, stop strings included."""
    from worker.llm import LLM

    rng = random.Random(test_seed)
    prompts = [[rng.randrange(5, 40000) for _ in range(n)] for n in (7, 30, 18)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for overlap in ("off", "on"):
        llm = LLM(
            tiny_models["llama"],
            device=AUTO_HERE[0],
            num_kv_blocks=64,
            max_num_seqs=4,
            overlap_outputs=overlap,
        )
        plain = llm.generate(prompts, params, use_tqdm=False)
        text = plain[1].outputs[0].text
        stop = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[text[3:5]])
        stopped = llm.generate(prompts[1], stop, use_tqdm=False)
        outputs[overlap] = [
            (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.finished)
            for o in plain + stopped
        ]
    assert outputs["on"] == outputs["off"]
    assert outputs["off"][3][2] is FinishReason.STOP and len(outputs["off"][3][0]) < 10
