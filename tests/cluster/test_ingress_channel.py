"""``IngressChannel`` without a cluster: one delivery in flight, what piles up meanwhile goes
in the next, ``flushed`` waits for what was pushed, a failed delivery breaks the channel."""

from __future__ import annotations

import asyncio

from cluster import ingress_channel
from cluster.ingress_channel import IngressChannel, IngressChannels
from tests.cluster.helpers import delta


def _connect_to(ingress):
    async def connect(address):
        return ingress.deliver

    return connect


class _Ingress:
    """Stands in for an ingress's push connection: records batches; each ``deliver`` waits
    for ``gate``."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self._fail_on = fail_on

    async def deliver(self, batch):
        await self.gate.wait()
        if self._fail_on is not None and len(self.batches) == self._fail_on:
            raise RuntimeError("the ingress replica is gone")
        self.batches.append(batch)


def test_outputs_pushed_while_a_delivery_is_in_flight_go_together_in_order():
    async def scenario():
        ingress = _Ingress()
        channel = IngressChannel("i", ingress.deliver)
        ingress.gate.clear()  # the first delivery hangs until released
        assert channel.push(delta(seq=1, request_id="a"))
        await asyncio.sleep(0)
        for i in range(2, 6):
            assert channel.push(delta(seq=i, request_id="a" if i % 2 else "b"))
        waiter = asyncio.create_task(channel.flushed())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # nothing delivered yet
        ingress.gate.set()
        await asyncio.wait_for(waiter, 1.0)
        channel.close()
        return ingress.batches, channel.num_deliveries

    batches, deliveries = asyncio.run(scenario())
    assert [[item.seq for item in b] for b in batches] == [[1], [2, 3, 4, 5]]
    assert [item.request_id for item in batches[1]] == ["b", "a", "b", "a"]
    assert deliveries == 2


def test_a_failed_delivery_breaks_the_channel_and_releases_its_waiters():
    async def scenario():
        ingress = _Ingress(fail_on=0)
        channel = IngressChannel("i", ingress.deliver)
        channel.push(delta(seq=1))
        await asyncio.wait_for(channel.flushed(), 1.0)
        pushed_after = channel.push(delta(seq=2))
        channels = IngressChannels(_connect_to(_Ingress()))
        first = await channels.get({"replica_id": "i"})
        first.broken = True  # a broken channel is replaced on the next request
        second = await channels.get({"replica_id": "i"})
        channels.close()
        return channel.broken, pushed_after, first is not second

    broken, pushed_after, replaced = asyncio.run(scenario())
    assert broken and not pushed_after and replaced


def test_an_unreachable_ingress_gives_no_channel_and_is_not_retried_at_once(monkeypatch):
    attempts = []

    async def connect(address):
        attempts.append(address["replica_id"])
        raise ConnectionRefusedError(f"nobody listens for {address['replica_id']}")

    async def scenario():
        channels = IngressChannels(connect)
        first = await channels.get({"replica_id": "gone"})
        second = await channels.get({"replica_id": "gone"})  # within RETRY_CONNECT_S
        monkeypatch.setattr(ingress_channel, "RETRY_CONNECT_S", 0.0)
        await channels.get({"replica_id": "other"})
        third = await channels.get({"replica_id": "other"})
        return first, second, third

    assert asyncio.run(scenario()) == (None, None, None)
    assert attempts == ["gone", "other", "other"]


def test_requests_that_arrive_while_a_channel_connects_share_its_one_connection():
    connects = []

    async def connect(address):
        connects.append(address["replica_id"])
        await asyncio.sleep(0.01)
        return _Ingress().deliver

    async def scenario():
        channels = IngressChannels(connect)
        got = await asyncio.gather(*(channels.get({"replica_id": "i"}) for _ in range(5)))
        channels.close()
        return got

    got = asyncio.run(scenario())
    assert connects == ["i"] and all(channel is got[0] for channel in got)
