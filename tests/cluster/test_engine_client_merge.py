"""``EngineClient.merge`` without a cluster: how a stream ends when its replica dies.

The handle call is a stand-in async iterator (the test judges ``merge``'s bookkeeping, not
Serve); the real failover through Serve is ``tests/cluster/tiny/test_replica_failover.py``.
"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorUnavailableError

from cluster.engine_client import EngineClient, _Stream
from worker.sampling_params import SamplingParams


class _DyingCall:
    """A handle call that yields ``items`` and then fails as a lost replica does."""

    def __init__(self, items: list[dict]) -> None:
        self._items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self._items:
            return self._items.pop(0)
        raise ActorUnavailableError("The actor is temporarily unavailable", None)

    def cancel(self) -> None:
        self.cancelled = True


def _item(token_id: int, finished: bool) -> dict:
    return {"outputs": [{"index": 0, "new_token_ids": [token_id]}], "finished": finished}


def _merge(items: list[dict]) -> list[dict]:
    client = EngineClient(None, block_size=16, model_id="m")
    stream = _Stream("r", [1, 2, 3], SamplingParams(max_tokens=3), None, _item(7, False), None)
    stream.response = _DyingCall(items)

    async def collect():
        return [item async for _, item in client.merge([stream])]

    return asyncio.run(collect())


def test_a_replica_lost_after_its_last_output_ends_the_stream_normally():
    got = _merge([_item(8, False), _item(9, True)])
    assert [i["outputs"][0]["new_token_ids"] for i in got] == [[7], [8], [9]]


def test_a_replica_lost_mid_stream_with_no_failover_left_reaches_the_caller():
    # n > 1 never fails over: the loss before the last output is the caller's error.
    client = EngineClient(None, block_size=16, model_id="m")
    params = SamplingParams(max_tokens=3, n=2)
    stream = _Stream("r", [1, 2, 3], params, None, _item(7, False), _DyingCall([_item(8, False)]))

    async def collect():
        return [item async for _, item in client.merge([stream])]

    with pytest.raises(ActorUnavailableError):
        asyncio.run(collect())


def test_an_engine_calls_first_output_is_reported_to_the_ledger_that_routed_it():
    """The stand-in handle does what Serve's router does with the call: it records the
    decision under the call's internal request id (the ingress sets one per call). When the
    first output arrives the client reports it, and that ledger marks the request as past
    its prefill (``cluster.inflight``)."""
    from ray.serve.context import _get_serve_request_context

    from cluster.inflight import InflightLedger

    ledger = InflightLedger(ttl_s=60.0)
    seen = {}

    class _Method:
        def remote(self, request_id, prompt_ids, params, **kwargs):
            seen["key"] = _get_serve_request_context()._internal_request_id
            ledger.decided(seen["key"], "a", len(prompt_ids))
            seen["awaiting"] = ledger.timed_snapshot()["a"][0][2]
            return _DyingCall([_item(7, False)])

    class _Handle:
        generate = _Method()

    client = EngineClient(_Handle(), block_size=16, model_id="m")
    first, _ = asyncio.run(client._open("r", [1, 2, 3], SamplingParams(max_tokens=3), None))
    assert first["outputs"][0]["new_token_ids"] == [7]
    assert seen["key"] and seen["awaiting"]  # a fresh id, awaiting at the decision
    assert ledger.timed_snapshot()["a"][0][2] is False
    assert ledger.marks_first_outputs
