"""``EngineReplica.generate``'s stream batching (``--stream-interval``), without Ray.

The replica's class is driven directly with a stand-in engine that yields one output per
step, as ``AsyncEngine`` does, so the test sees exactly the messages the ingress would get.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest

from cluster.metrics_snapshots import ReplicaMetrics
from cluster.replica import EngineReplica
from worker.outputs import ChoiceDelta, FinishReason, OutputDelta
from worker.sampling_params import SamplingParams

NUM_TOKENS = 10


class StepEngine:
    """Yields one token per step for NUM_TOKENS steps, a delta each, like the real engine."""

    async def generate(
        self,
        request_id,
        prompt_token_ids,
        params,
        cache_salt=None,
        resume_token_ids=(),
        lora_name=None,
        sink=None,
    ):
        assert sink is None, "no sink without push_to"
        for step in range(NUM_TOKENS):
            token, last = 100 + step, step == NUM_TOKENS - 1
            choice = ChoiceDelta(
                0,
                [token],
                f"<{token}>",
                finish_reason=FinishReason.LENGTH if last else None,
                text="".join(f"<{100 + i}>" for i in range(NUM_TOKENS)) if last else None,
            )
            yield OutputDelta(request_id, len(prompt_token_ids), 0, [choice], finished=last)


def replica(stream_interval: int):
    self = object.__new__(EngineReplica.func_or_class)
    self.engine, self.replica_id, self.metrics = StepEngine(), "r0", ReplicaMetrics()
    self._in_flight, self.stream_interval = set(), stream_interval
    return self


async def messages(stream_interval: int) -> list[OutputDelta]:
    params = SamplingParams(max_tokens=NUM_TOKENS)
    return [m async for m in replica(stream_interval).generate("req", [1, 2, 3], params)]


@pytest.mark.parametrize(("interval", "sizes"), [(1, [1] * 10), (4, [1, 4, 4, 1]), (20, [1, 9])])
def test_messages_carry_interval_tokens_first_and_last_at_once(interval, sizes):
    out = asyncio.run(messages(interval))
    choices = [m.choices[0] for m in out]
    assert [len(c.new_token_ids) for c in choices] == sizes
    assert [t for c in choices for t in c.new_token_ids] == [100 + i for i in range(NUM_TOKENS)]
    assert "".join(c.new_text for c in choices) == choices[-1].text
    assert out[-1].finished and choices[-1].finish_reason is FinishReason.LENGTH
    assert [m.seq for m in out] == list(range(len(out)))
    assert {m.replica_id for m in out} == {"r0"}


# -- pushed outputs: the engine's sink feeds the ingress channel (generate's sink) ------------
def engine_replica(model: str, stream_interval: int, deliver=None):
    """An ``EngineReplica`` over a real engine in a thread of this process; its channels
    connect to push servers as the replica's do, or deliver through ``deliver``."""
    from cluster.ingress_channel import IngressChannels
    from cluster.replica import _deliver_to
    from worker.async_engine import AsyncEngine
    from worker.config import EngineConfig

    async def stand_in(address):
        return deliver

    self = replica(stream_interval)
    self.engine = AsyncEngine(EngineConfig(model=model, num_kv_blocks=64), "r0", spawn=False)
    self._channels = IngressChannels(_deliver_to if deliver is None else stand_in)
    return self


async def pushed_run(model: str, stream_interval: int, break_after: int | None = None):
    """(what the call yielded, what was pushed, in order), pushed over a real connection to a
    push server in this process; or with ``break_after``, to a stand-in that takes that many
    batches and then fails as a connection to a lost ingress does."""
    from cluster.push_socket import PushServer

    pushed: list[OutputDelta] = []
    calls = 0

    async def deliver(batch):
        nonlocal calls
        calls += 1
        if calls > break_after:
            raise ConnectionError("ingress replica is gone")
        await asyncio.sleep(0)  # the ingress answers on a later loop turn
        pushed.extend(pickle.loads(pickle.dumps(batch)))  # as the connection carries it

    server = await PushServer.start(pushed.extend, "127.0.0.1")
    push_to = {"replica_id": "ingress-1", **server.address}
    r = engine_replica(model, stream_interval, None if break_after is None else deliver)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    try:
        yielded = [m async for m in r.generate("req", [5, 6, 7, 8], params, push_to=push_to)]
    finally:
        r._channels.close()
        server.close()
        await r.engine.shutdown()
    return yielded, pushed


def _tokens(messages: list[OutputDelta]) -> list[int]:
    return [t for m in messages for c in m.choices for t in c.new_token_ids]


@pytest.mark.parametrize("interval", [1, 4])
def test_every_output_but_the_last_goes_through_the_channel(tiny_models, interval):
    """The call yields the last output only; every output before it, the first included,
    goes to the channel, once each, numbered in order, and together they are the unpushed
    stream's."""
    direct = asyncio.run(_direct_run(tiny_models["llama"], interval))
    yielded, pushed = asyncio.run(pushed_run(tiny_models["llama"], interval))
    assert len(yielded) == 1 and pushed and pushed[0].seq == 0
    stream = sorted(yielded + pushed, key=lambda m: m.seq)
    assert [m.seq for m in stream] == list(range(len(stream)))
    assert yielded[-1].seq == len(stream) - 1 and yielded[-1].finished
    assert _tokens(stream) == _tokens(direct) and len(_tokens(stream)) == 24
    sizes = [len(c.new_token_ids) for m in stream for c in m.choices]
    # The first output goes at once, whatever the interval: one token, or the few steps that
    # piled up before a busy replica's loop took them (AsyncEngine joins them).
    assert sizes[0] >= 1 and all(size >= interval for size in sizes[1:-1]), sizes


def test_a_channel_that_breaks_mid_stream_hands_the_rest_back_to_the_call(tiny_models):
    """The ingress is gone after one delivery: what it got plus what the call yields after
    is still the whole stream in order, with nothing pushed twice."""
    direct = asyncio.run(_direct_run(tiny_models["llama"], 1))
    yielded, pushed = asyncio.run(pushed_run(tiny_models["llama"], 1, break_after=1))
    assert len(yielded) > 1  # the outputs after the break came through the call
    seqs = sorted(m.seq for m in yielded + pushed)
    assert seqs[0] == 0 and len(set(seqs)) == len(seqs)
    got = _tokens(sorted(yielded + pushed, key=lambda m: m.seq))
    want = _tokens(direct)
    # What is missing is one run of tokens (the batch in flight when it broke): the same
    # tokens as the unbroken stream before it and after it. (How steps group into outputs
    # depends on how fast each run's loop read them, so runs are compared token by token.)
    head = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got))
    tail = len(got) - head
    assert len(got) <= len(want) and got[head:] == want[len(want) - tail :]


async def _direct_run(model: str, stream_interval: int) -> list[OutputDelta]:
    async def never(batch):
        raise AssertionError("nothing is pushed without push_to")

    r = engine_replica(model, stream_interval, never)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    try:
        return [m async for m in r.generate("req", [5, 6, 7, 8], params)]
    finally:
        await r.engine.shutdown()
