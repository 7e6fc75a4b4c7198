"""``OutputDelta``, the one shape a streamed token takes: its pickled form, how deltas join
(a slow reader, ``--stream-interval``) and how they add up to a cumulative output."""

from __future__ import annotations

import pickle
from dataclasses import fields

from worker.outputs import (
    ChoiceDelta,
    FinishReason,
    OutputDelta,
    TokenLogprob,
    accumulate,
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
