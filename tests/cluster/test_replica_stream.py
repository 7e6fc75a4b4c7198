"""``EngineReplica.generate``'s stream batching (``--stream-interval``), without Ray.

The replica's class is driven directly with a stand-in engine that yields one output per
step, as ``AsyncEngine`` does, so the test sees exactly the messages the ingress would get.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.metrics import ReplicaMetrics
from cluster.replica import EngineReplica
from worker.outputs import CompletionOutput, FinishReason, RequestOutput
from worker.sampling_params import SamplingParams

NUM_TOKENS = 10


class StepEngine:
    """Yields one token per step for NUM_TOKENS steps, cumulative like the real engine."""

    async def generate(
        self, request_id, prompt_token_ids, params, cache_salt=None, resume_token_ids=()
    ):
        tokens: list[int] = []
        for step in range(NUM_TOKENS):
            tokens.append(100 + step)
            last = step == NUM_TOKENS - 1
            completion = CompletionOutput(
                0,
                "".join(f"<{t}>" for t in tokens),
                list(tokens),
                f"<{tokens[-1]}>",
                [tokens[-1]],
                finish_reason=FinishReason.LENGTH if last else None,
            )
            yield RequestOutput(request_id, list(prompt_token_ids), [completion], finished=last)


def replica(stream_interval: int):
    self = object.__new__(EngineReplica.func_or_class)
    self.engine, self.replica_id, self.metrics = StepEngine(), "r0", ReplicaMetrics()
    self._in_flight, self.stream_interval = set(), stream_interval
    return self


async def messages(stream_interval: int) -> list[dict]:
    params = SamplingParams(max_tokens=NUM_TOKENS)
    return [m async for m in replica(stream_interval).generate("req", [1, 2, 3], params)]


@pytest.mark.parametrize(("interval", "sizes"), [(1, [1] * 10), (4, [1, 4, 4, 1]), (20, [1, 9])])
def test_messages_carry_interval_tokens_first_and_last_at_once(interval, sizes):
    out = asyncio.run(messages(interval))
    choices = [m["outputs"][0] for m in out]
    assert [len(c["new_token_ids"]) for c in choices] == sizes
    assert [t for c in choices for t in c["new_token_ids"]] == [100 + i for i in range(NUM_TOKENS)]
    assert "".join(c["new_text"] for c in choices) == choices[-1]["text"]
    assert out[-1]["finished"] and choices[-1]["finish_reason"] == "length"
