"""``EngineClient.merge`` without a cluster: how a stream ends when its replica dies, and
how outputs pushed by a replica (``EngineClient.deliver``) and those of the handle call
become one stream in order.

The handle call is a stand-in async iterator (the test judges ``merge``'s bookkeeping, not
Serve); the real failover through Serve is ``tests/cluster/tiny/test_replica_failover.py``.
"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorUnavailableError

from cluster.engine_call import EngineCall, Inbox
from cluster.engine_client import EngineClient, ReplicaDiedError, _Stream
from tests.cluster.helpers import delta
from worker.outputs import OutputDelta
from worker.sampling_params import SamplingParams


class _DyingCall:
    """A handle call that yields ``items`` and then fails as a lost replica does."""

    def __init__(self, items: list[OutputDelta]) -> None:
        self._items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> OutputDelta:
        if self._items:
            return self._items.pop(0)
        raise ActorUnavailableError("The actor is temporarily unavailable", None)

    def cancel(self) -> None:
        self.cancelled = True


class _EndingCall(_DyingCall):
    """A handle call that yields ``items`` after ``before_end`` ran, then ends normally."""

    def __init__(self, items: list[OutputDelta], before_end=None) -> None:
        super().__init__(items)
        self._before_end = before_end

    async def __anext__(self) -> OutputDelta:
        if self._before_end is not None:
            before, self._before_end = self._before_end, None
            before()
        if self._items:
            return self._items.pop(0)
        raise StopAsyncIteration


def _item(token_id: int, finished: bool, seq: int = 0) -> OutputDelta:
    return delta(0, "", [token_id], "length" if finished else None, seq=seq, request_id="r")


def _stream(call, params=None, first=None) -> _Stream:
    params = params or SamplingParams(max_tokens=3)
    return _Stream("r", [1, 2, 3], params, None, first or _item(7, False), EngineCall("r", *call))


def _merge(items: list[OutputDelta]) -> list[OutputDelta]:
    client = EngineClient(None, block_size=16, cache_namespace="m")

    async def collect():
        stream = _stream((Inbox(), _DyingCall(items)))
        return [item async for _, outputs in client.merge([stream]) for item in outputs]

    return asyncio.run(collect())


def test_a_replica_lost_after_its_last_output_ends_the_stream_normally():
    got = _merge([_item(8, False, 1), _item(9, True, 2)])
    assert [i.new_token_ids for i in got] == [[7], [8], [9]]


def test_a_replica_lost_mid_stream_with_no_failover_left_reaches_the_caller():
    # n > 1 never fails over: the loss before the last output is the caller's error.
    client = EngineClient(None, block_size=16, cache_namespace="m")
    params = SamplingParams(max_tokens=3, n=2)

    async def collect():
        stream = _stream((Inbox(), _DyingCall([_item(8, False, 1)])), params)
        return [item async for _, outputs in client.merge([stream]) for item in outputs]

    with pytest.raises(ActorUnavailableError):
        asyncio.run(collect())


def test_an_engine_calls_first_output_is_reported_to_the_tracker_it_was_handed():
    """The stand-in handle does what Serve's request router does with the call: it tells the
    load tracker of the decision, under the call's internal request id (the client sets one
    per call). When the first output arrives the client reports it to the tracker it was
    handed, which then counts the request as running, no longer queued (``router.load``)."""
    from ray.serve.context import _get_serve_request_context

    from router.load import LoadTracker

    tracker = LoadTracker()
    seen = {}

    class _Method:
        def remote(self, request_id, prompt_ids, params, **kwargs):
            seen["key"] = _get_serve_request_context()._internal_request_id
            tracker.decided(seen["key"], "a", len(prompt_ids))
            seen["queued"] = [r.queued for r in tracker.snapshot().on("a")]
            return _DyingCall([_item(7, False)])

    class _Handle:
        generate = _Method()

    client = EngineClient(_Handle(), block_size=16, cache_namespace="m", load=tracker)
    first, _ = asyncio.run(client._open("r", [1, 2, 3], SamplingParams(max_tokens=3), None))
    assert first.new_token_ids == [7]
    assert seen["key"] and seen["queued"] == [True]  # a fresh id, queued at the decision
    (request,) = tracker.snapshot().on("a")
    assert request.first_output_at_s is not None and not request.queued


def _pushed_run(
    pushed: list[OutputDelta], last: OutputDelta, params: SamplingParams | None = None
) -> list[OutputDelta]:
    """A call whose replica pushed ``pushed`` (delivered before its handle's last output, as
    ``IngressChannel.flushed`` makes it) and then sent ``last`` through the handle."""
    client = EngineClient(None, block_size=16, cache_namespace="m", push_to={"replica_id": "i"})

    async def collect():
        inbox = Inbox()
        client._inboxes["r"] = inbox
        call = _EndingCall([last], lambda: client.deliver(pushed))
        stream = _stream((inbox, call), params, first=_item(7, False, 0))
        got = [item async for _, outputs in client.merge([stream]) for item in outputs]
        assert "r" not in client._inboxes  # the ended call's inbox is gone
        client.deliver([_item(99, False, 9)])  # a late push is dropped, not kept
        return got

    return asyncio.run(collect())


def test_pushed_outputs_and_the_handles_last_one_make_one_stream_in_order():
    got = _pushed_run([_item(8, False, 1), _item(9, False, 2)], _item(10, True, 3))
    assert [i.new_token_ids for i in got] == [[7], [8], [9], [10]]


def test_a_lost_push_is_a_lost_replica():
    """An output that never arrived (its channel broke) shows as a gap in the numbers: the
    stream fails over as for a dead replica; with n > 1, which never fails over, the error
    reaches the caller."""
    with pytest.raises(ReplicaDiedError, match="lost in transit"):
        _pushed_run([_item(8, False, 1)], _item(10, True, 3), SamplingParams(max_tokens=3, n=2))


def test_a_pushed_first_output_opens_the_call_before_the_handle_yields():
    """The replica pushes a call's first output too: the call is open once it arrives,
    while the handle stream, which carries only the last output, has yielded nothing."""
    client = EngineClient(None, block_size=16, cache_namespace="m", push_to={"replica_id": "i"})
    released = asyncio.Event()

    class _LastOnly(_EndingCall):
        async def __anext__(self) -> OutputDelta:
            await released.wait()
            return await super().__anext__()

    class _Method:
        def remote(self, request_id, prompt_ids, params, **kwargs):
            asyncio.get_running_loop().call_soon(client.deliver, [_item(7, False, 0)])
            return _LastOnly([_item(9, True, 2)])

    class _Handle:
        generate = _Method()

    client._stream_handle = _Handle()

    async def run():
        opening = client._open("r", [1, 2, 3], SamplingParams(max_tokens=3), None)
        first, call = await asyncio.wait_for(opening, 5.0)
        assert first.new_token_ids == [7] and not released.is_set()
        client.deliver([_item(8, False, 1)])
        released.set()
        stream = _Stream("r", [1, 2, 3], SamplingParams(max_tokens=3), None, first, call)
        return [item async for _, outputs in client.merge([stream]) for item in outputs]

    got = asyncio.run(run())
    assert [i.new_token_ids for i in got] == [[7], [8], [9]]


def _pushed_lists(pushed: list[OutputDelta], last: OutputDelta, params=None) -> list[list]:
    """``merge``'s lists for a call whose pushes all arrived before the reader asked."""
    client = EngineClient(None, block_size=16, cache_namespace="m", push_to={"replica_id": "i"})

    async def collect():
        inbox = Inbox()
        client._inboxes["r"] = inbox
        client.deliver(pushed)
        call = _EndingCall([last])
        stream = _stream((inbox, call), params, first=_item(7, False, 0))
        lists = []
        try:
            async for _, outputs in client.merge([stream]):
                lists.append([i.new_token_ids[0] for i in outputs])
        except ReplicaDiedError as exc:
            lists.append(exc)
        return lists

    return asyncio.run(collect())


def test_outputs_that_arrived_while_the_reader_was_busy_come_in_one_list():
    """A reader that falls behind gets every output that waited in one list (one write to
    its client); the first output comes alone, and the handle's last follows in order."""
    lists = _pushed_lists([_item(8, False, 1), _item(9, False, 2)], _item(10, True, 3))
    assert lists[0] == [7]
    assert [t for part in lists for t in part] == [7, 8, 9, 10]
    assert [8, 9] in lists or [8, 9, 10] in lists  # not one list per output


def test_outputs_before_a_lost_push_reach_the_reader_before_the_error():
    """A gap in a list that arrived together: what came before it is the client's (a
    failover resumes from it), then the stream fails as for a dead replica."""
    params = SamplingParams(max_tokens=3, n=2)  # never fails over: the error reaches us
    lists = _pushed_lists([_item(8, False, 1), _item(10, False, 3)], _item(11, True, 4), params)
    assert lists[:2] == [[7], [8]]
    assert isinstance(lists[2], ReplicaDiedError) and "lost in transit" in str(lists[2])


def test_a_reader_that_leaves_mid_stream_ends_the_engine_call_and_its_inbox():
    """The client went away: closing the stream cancels the handle call (which aborts the
    engine request and frees its blocks) and drops the inbox, so later pushes are dropped."""
    client = EngineClient(None, block_size=16, cache_namespace="m", push_to={"replica_id": "i"})

    class _Open(_DyingCall):
        async def __anext__(self) -> OutputDelta:
            await asyncio.Event().wait()  # the last output never comes

    async def run():
        inbox = Inbox()
        client._inboxes["r"] = inbox
        call = _Open([])
        stream = _stream((inbox, call), first=_item(7, False, 0))
        items = client.merge([stream])
        got = [await anext(items)]
        client.deliver([_item(8, False, 1)])
        got.append(await anext(items))
        await items.aclose()
        return got, call.cancelled

    got, cancelled = asyncio.run(run())
    assert [[i.new_token_ids for i in outputs] for _, outputs in got] == [[[7]], [[8]]]
    assert cancelled and "r" not in client._inboxes
