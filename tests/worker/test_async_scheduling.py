"""Steps scheduled before the last step's tokens reach the host
(``EngineConfig.async_scheduling``, ``LLMEngine.launch_step(ahead_of=...)``).

Scheduling ahead changes when the host sees tokens, never which tokens: a step of plain
greedy or plainly drawn sequences lets the next one launch with those sequences' tokens
taken on the device, and the stop checks run while it computes. So every request streams
the same tokens, text and finishes as with each step scheduled after the last one's tokens:
requests stopped by a stop token, a stop string or ``max_tokens`` (whose extra computed row
is dropped), requests preempted for blocks while a token is in flight, and a request aborted
between two steps in flight, whose blocks all come back. Sequences drawn by temperature
alone are drawn on the device at the launch too; a step with a scored, penalized, filtered
(top-k, top-p, min-p) or constrained sequence is not run ahead of. Checked on the
simulated engine and a real tiny model (on CUDA where visible: the GPU check runs these
tests there). ``auto`` schedules ahead for the simulated engine only; a model's engine opts
in with ``on``.
"""

from __future__ import annotations

import random

import pytest

from tests.worker.test_overlap_outputs import add, stream
from tests.worker.test_overlap_outputs import make_engine as overlap_engine
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.engine_commands import Abort
from worker.engine_core import EngineLoop
from worker.sampling_params import SamplingParams


def make_engine(tiny_models, engine: str, schedule_ahead: bool, **kw) -> LLMEngine:
    """The overlap tests' engine, each step scheduled ahead where it can be, or none."""
    ahead = "on" if schedule_ahead else "off"
    kw.setdefault("async_scheduling", ahead)
    return overlap_engine(tiny_models, engine, ahead, **kw)


def count_ahead(engine: LLMEngine) -> list[int]:
    """Counts the steps launched ahead of the step before's tokens: [count]."""
    launch, counter = engine.launch_step, [0]

    def counted(ahead_of=None):
        counter[0] += ahead_of is not None
        return launch(ahead_of)

    engine.launch_step = counted
    return counter


def greedy_workload(rng: random.Random, stop_token: int | None, stop: str | None) -> list:
    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, 40000) for _ in range(n)]

    def greedy(max_tokens: int, **kw) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)

    shared = prompt(20)
    return [
        [add("a", shared + prompt(5), greedy(14)), add("b", prompt(30), greedy(3))],
        [add("c", prompt(7), greedy(16, stop_token_ids=[stop_token] if stop_token else []))],
        [
            add("d", shared + prompt(9), greedy(12, stop=[stop] if stop else [])),
            add("e", [7], greedy(1)),
        ],
        [],
        [add("late", prompt(40), greedy(10))],
    ]


@pytest.mark.parametrize("engine_kind", ["sim", "model"])
def test_scheduling_ahead_changes_when_tokens_are_seen_not_which(
    tiny_models, test_seed, engine_kind
):
    plain = stream(
        make_engine(tiny_models, engine_kind, False),
        greedy_workload(random.Random(test_seed), None, None),
    )
    # A stop token that request c emits mid-stream, and a stop string in request d's text.
    stop_token = plain["c/0"]["ids"][5]
    text = plain["d/0"]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    off = stream(
        make_engine(tiny_models, engine_kind, False),
        greedy_workload(random.Random(test_seed), stop_token, stop),
    )
    engine = make_engine(tiny_models, engine_kind, True)
    ahead = count_ahead(engine)
    on = stream(engine, greedy_workload(random.Random(test_seed), stop_token, stop))
    assert ahead[0] > 10  # most steps ran ahead of the step before's tokens
    assert on == off
    assert off["c/0"]["finish"][1] == stop_token and len(off["c/0"]["ids"]) <= 6
    assert off["d/0"]["finish"][1] == stop
    assert [len(off[r]["ids"]) for r in ("a/0", "b/0", "e/0", "late/0")] == [14, 3, 1, 10]


@pytest.mark.parametrize("engine_kind", ["sim", "model"])
def test_sequences_preempted_with_a_token_in_flight_keep_their_tokens(
    tiny_models, test_seed, engine_kind
):
    """Too few blocks for every running sequence: the scheduler preempts while tokens are
    in flight, and the preempted sequences recompute with them."""
    rng = random.Random(test_seed)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    arrivals = [
        [add(f"r{i}", [rng.randrange(5, 40000) for _ in range(18)], params)] for i in range(5)
    ]
    outputs = {}
    for ahead in (False, True):
        engine = make_engine(tiny_models, engine_kind, ahead, num_kv_blocks=14)
        outputs[ahead] = stream(engine, arrivals)
        assert engine.scheduler.counters.num_preemptions > 0
    assert outputs[True] == outputs[False]
    assert all(len(out["ids"]) == 40 for out in outputs[True].values())


@pytest.mark.parametrize("engine_kind", ["sim", "model"])
def test_drawn_sequences_are_scheduled_ahead_and_draw_the_same_tokens(
    tiny_models, test_seed, engine_kind
):
    """Sequences drawn by their temperature alone are drawn on the device at the launch,
    keyed by the position after their token in flight; with top-k, top-p or min-p they are
    drawn when their step is sampled (not run ahead of), the same tokens either way."""
    rng = random.Random(test_seed)

    def drawn(seed: int, **kw) -> SamplingParams:
        kw.setdefault("temperature", 0.9)
        return SamplingParams(seed=seed, max_tokens=12, ignore_eos=True, **kw)

    def workload() -> list:
        prompts = [[rng.randrange(5, 40000) for _ in range(8 + i)] for i in range(6)]
        return [
            [add("t", prompts[0], drawn(1)), add("u", prompts[1], drawn(2, temperature=1.3))],
            [add("g", prompts[2], SamplingParams(temperature=0, max_tokens=9))],
            [],
            *([[]] * 12),  # the three above run alone a while: ahead of every step
            [add("p", prompts[3], drawn(3, top_p=0.8)), add("k", prompts[4], drawn(4, top_k=20))],
            [add("m", prompts[5], drawn(5, min_p=0.1))],
        ]

    state = rng.getstate()
    off = stream(make_engine(tiny_models, engine_kind, False), workload())
    rng.setstate(state)
    engine = make_engine(tiny_models, engine_kind, True)
    ahead = count_ahead(engine)
    on = stream(engine, workload())
    assert ahead[0] > 5
    assert on == off
    assert all(len(off[f"{r}/0"]["ids"]) == 12 for r in "tupkm")


@pytest.mark.parametrize("engine_kind", ["sim", "model"])
def test_a_step_with_a_scored_penalized_or_filtered_sequence_is_not_run_ahead_of(
    tiny_models, engine_kind
):
    engine = make_engine(tiny_models, engine_kind, True)
    ahead = count_ahead(engine)
    penalized = SamplingParams(
        temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, presence_penalty=0.5
    )
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    filtered = SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True, top_p=0.9)
    stream(engine, [[add("s", [5, 6, 7], penalized), add("l", [8, 9, 10], scored)]])
    stream(engine, [[add("f", [11, 12, 13], filtered)]])
    assert ahead[0] == 0


def test_an_abort_between_two_steps_in_flight_returns_every_block(tiny_models):
    engine = make_engine(tiny_models, "sim", True)
    loop = EngineLoop(engine)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    loop.handle(add("x", list(range(5, 40)), params))
    loop.handle(add("y", list(range(50, 70)), params))
    got = {"x": [], "y": []}
    for step in range(60):
        if step == 6:
            loop.handle(Abort("x"))
        result = loop.step()
        for delta in result.outputs if result else []:
            got[delta.request_id] += delta.new_token_ids
        engine.scheduler.check_invariants()
        if loop.idle():
            break
    assert loop.idle() and len(got["y"]) == 30 and 0 < len(got["x"]) < 30
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_auto_schedules_ahead_for_the_simulated_engine_and_on_needs_the_overlap(tiny_models):
    assert make_engine(tiny_models, "sim", True, async_scheduling="auto").schedules_ahead
    assert not make_engine(tiny_models, "sim", False, async_scheduling="auto").schedules_ahead
    # A model's engine schedules ahead only when asked (``on``), overlapped.
    assert not make_engine(tiny_models, "model", True, async_scheduling="auto").schedules_ahead
    assert make_engine(tiny_models, "model", True, async_scheduling="on").schedules_ahead
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="x", overlap_outputs="off", async_scheduling="on")
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="x", async_scheduling="sometimes")
