"""``OutputDelta``, the one shape a streamed token takes: its pickled form and its wire form
(what a step's deltas cross the engine socket and the replica-to-ingress hop as), how deltas
join (a slow reader, ``--stream-interval``) and how they add up to a cumulative output."""

from __future__ import annotations

import io
import pickle
from dataclasses import fields
from multiprocessing.reduction import ForkingPickler

import pytest

from router.protocol import ReplicaStats
from worker.engine_core import StepResult
from worker.outputs import (
    ChoiceDelta,
    FinishReason,
    OutputDelta,
    TokenLogprob,
    accumulate,
    deltas_from_wire,
    deltas_to_wire,
)


def full_delta() -> OutputDelta:
    """A delta with every field away from its default."""
    choice = ChoiceDelta(
        1,
        [7, 8],
        "ab",
        [TokenLogprob(7, -0.5, [(7, -0.5)]), TokenLogprob(8, -0.25, [])],
        FinishReason.STOP,
        "</s>",
        "xab",
    )
    return OutputDelta(
        "req",
        12,
        8,
        [choice],
        finished=True,
        error="boom",
        metrics={"arrival_time": 1.0},
        prompt_logprobs=[None, TokenLogprob(3, -1.0, [], rank=2)],
        seq=4,
        replica_id="r1",
    )


def test_a_pickled_delta_keeps_every_field():
    delta = full_delta()
    assert len(delta.__getstate__()) == len(fields(OutputDelta))
    assert len(delta.choices[0].__getstate__()) == len(fields(ChoiceDelta))
    assert pickle.loads(pickle.dumps(delta)) == delta


class _BuiltinsOnly(pickle.Unpickler):
    """Refuses every class or function a pickle names: what it reads is plain data."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the wire form names {module}.{name}")


def plain_delta(request_id: str, token_id: int) -> OutputDelta:
    return OutputDelta(request_id, 3, 0, [ChoiceDelta(0, [token_id], "x")])


def test_the_wire_form_is_plain_data_and_reads_back_every_field():
    """A step's deltas cross two sockets per token; their wire form is tuples, lists, strings
    and numbers, which pickle writes and reads without a Python call per object."""
    deltas = [plain_delta("a", 5), plain_delta("b", 6)]
    payload = pickle.dumps(deltas_to_wire(deltas), protocol=pickle.HIGHEST_PROTOCOL)
    rows = _BuiltinsOnly(io.BytesIO(payload)).load()
    assert deltas_from_wire(rows) == deltas
    full = full_delta()  # logprobs and finish reasons keep their own classes
    assert deltas_from_wire(pickle.loads(pickle.dumps(deltas_to_wire([full])))) == [full]
    with pytest.raises(pickle.UnpicklingError):  # the check above can fail
        _BuiltinsOnly(io.BytesIO(pickle.dumps(deltas))).load()


def test_a_step_result_carries_its_deltas_in_their_wire_form():
    """The engine process sends one ``StepResult`` per step: its outputs come back equal,
    and the pickle names no delta class (each would cost a reduce call per delta)."""
    deltas = [plain_delta(f"r{i}", i) for i in range(4)] + [full_delta()]
    result = StepResult(deltas, [], ReplicaStats(), {"x": 1.0}, [], 7, [(3, "answer")])
    payload = bytes(ForkingPickler.dumps(result))
    assert pickle.loads(payload) == result
    assert b"OutputDelta" not in payload and b"ChoiceDelta" not in payload


def test_joined_deltas_say_what_both_said():
    earlier = OutputDelta(
        "r",
        3,
        0,
        [ChoiceDelta(0, [1], "a", [TokenLogprob(1, -0.1)]), ChoiceDelta(1, [5], "e")],
        metrics={"first_token_time": 1.0},
    )
    later = OutputDelta(
        "r",
        3,
        2,
        [ChoiceDelta(0, [2], "b", [TokenLogprob(2, -0.2)], FinishReason.LENGTH, None, "ab")],
        finished=False,
    )
    joined = earlier.extend(later)
    assert [c.index for c in joined.choices] == [0, 1]
    first, second = joined.choices
    assert (first.new_token_ids, first.new_text) == ([1, 2], "ab")
    assert [lp.token_id for lp in first.new_logprobs] == [1, 2]
    assert (first.finish_reason, first.text) == (FinishReason.LENGTH, "ab")
    assert (second.new_token_ids, second.finish_reason) == ([5], None)
    assert joined.num_cached_tokens == 2
    assert joined.metrics == {"first_token_time": 1.0}  # kept: the later delta had none


def test_deltas_add_up_to_the_cumulative_output_after_resumed_tokens():
    deltas = [
        OutputDelta("r", 2, 1, [ChoiceDelta(0, [10], "x")], prompt_logprobs=[None]),
        OutputDelta("r", 2, 1, [ChoiceDelta(0, [11], "yz", None, FinishReason.STOP, 11, "xy")]),
    ]
    deltas[-1].finished = True
    out = accumulate(deltas, [4, 5], resume_token_ids=[9])
    (choice,) = out.outputs
    assert choice.token_ids == [9, 10, 11] and choice.text == "xy"  # the stop string cut
    assert (choice.finish_reason, choice.stop_reason) == (FinishReason.STOP, 11)
    assert out.finished and out.num_cached_tokens == 1 and out.prompt_logprobs == [None]
    assert out.prompt_token_ids == [4, 5]
