"""The push connection between an engine replica and an ingress replica, over loopback TCP:
frames arrive whole and in order and each is confirmed once handed over; a wrong token, an
oversized frame or a closed ingress end the connection, and the replica's send says so."""

from __future__ import annotations

import asyncio

import pytest

from cluster import push_socket
from cluster.ingress_channel import IngressChannel
from cluster.push_socket import PushConnection, PushServer
from tests.cluster.helpers import delta


async def _server():
    batches: list[list] = []
    server = await PushServer.start(batches.append, "127.0.0.1")
    return server, batches


def test_batches_arrive_in_order_and_send_returns_once_the_ingress_has_them():
    async def scenario():
        server, batches = await _server()
        connection = await PushConnection.open(server.address)
        seen_after_send = []
        for i in range(50):
            batch = [delta(seq=i, request_id=f"r{i % 3}", new_ids=list(range(i)))]
            await connection.send(batch)
            seen_after_send.append(len(batches))
        connection.close()
        server.close()
        return batches, seen_after_send

    batches, seen_after_send = asyncio.run(scenario())
    assert seen_after_send == list(range(1, 51))  # confirmed means handed over
    assert [b[0].seq for b in batches] == list(range(50))
    assert batches[7][0].request_id == "r1" and batches[7][0].choices[0].new_token_ids == list(
        range(7)
    )


def test_frames_split_across_reads_are_put_back_together():
    """A large frame arrives in many TCP reads; several small ones can share one."""

    async def scenario():
        server, batches = await _server()
        connection = await PushConnection.open(server.address)
        big = [delta(seq=i, new_ids=list(range(2000))) for i in range(40)]
        await connection.send(big)
        sends = [connection.send([delta(seq=i)]) for i in range(3)]
        for send in sends:  # written back to back, before any answer is read
            await send
        connection.close()
        server.close()
        return batches

    batches = asyncio.run(scenario())
    assert [len(b) for b in batches] == [40, 1, 1, 1]
    assert batches[0][39].choices[0].new_token_ids == list(range(2000))


def test_a_connection_with_the_wrong_token_is_closed_unheard():
    async def scenario():
        server, batches = await _server()
        forged = dict(server.address, token="00" * push_socket.TOKEN_BYTES)
        connection = await PushConnection.open(forged)
        with pytest.raises(ConnectionError):
            await connection.send([delta()])
        server.close()
        return batches

    assert asyncio.run(scenario()) == []


def test_an_oversized_frame_closes_the_connection(monkeypatch):
    monkeypatch.setattr(push_socket, "MAX_FRAME_BYTES", 1000)

    async def scenario():
        server, batches = await _server()
        connection = await PushConnection.open(server.address)
        await connection.send([delta()])
        with pytest.raises(ConnectionError):
            await connection.send([delta(new_ids=list(range(5000)))])
        server.close()
        return batches

    assert len(asyncio.run(scenario())) == 1


def test_an_ingress_that_is_gone_breaks_the_channel_that_pushed_to_it():
    """The ingress closes (its replica stopped): the channel's next delivery fails, the
    channel breaks and refuses pushes, so the replica streams through the handle calls."""

    async def scenario():
        server, batches = await _server()
        connection = await PushConnection.open(server.address)
        channel = IngressChannel("i", connection.send)
        channel.push(delta(seq=0))
        await asyncio.wait_for(channel.flushed(), 5.0)
        server.close()
        channel.push(delta(seq=1))
        await asyncio.wait_for(channel.flushed(), 5.0)
        return batches, channel.broken, channel.push(delta(seq=2))

    batches, broken, pushed_after = asyncio.run(scenario())
    assert [b[0].seq for b in batches] == [0]
    assert broken and not pushed_after


def test_an_address_nobody_listens_on_fails_to_open():
    async def scenario():
        server, _ = await _server()
        address = server.address
        server.close()
        await server.wait_closed()
        with pytest.raises(OSError):
            await PushConnection.open(address)

    asyncio.run(scenario())
