"""The TCP connection an engine replica pushes a request's outputs over to an ingress replica.

``cluster/ingress_channel.py`` batches every request's outputs of an engine step for one
ingress replica; this module carries those batches. Each ingress replica listens on its
node's address (``PushServer``); each engine replica opens one connection per ingress replica
it pushes to (``PushConnection``) and sends one frame per batch. A Serve call per batch would
go through Serve's request wrapping, its metrics and Ray's task machinery on both sides; a
frame costs a pickle, a write and a read.

Wire format: the connection opens with the ingress's token (``TOKEN_BYTES`` random bytes in
its address, which reaches engine replicas only inside Ray calls); then frames, each a
4-byte big-endian length and a pickled ``list[OutputDelta]`` in its wire form
(``worker.outputs.deltas_to_wire``: plain tuples, which pickle reads and writes in C). The
ingress answers each frame with one byte once its outputs are in their calls' inboxes, so an
answered frame is a delivered one (what ``IngressChannel.flushed`` waits for).

How it fails: a wrong token, a frame over ``MAX_FRAME_BYTES`` or one that does not decode
closes the connection unanswered (logged on the ingress); a closed connection or an ingress
that does not answer within ``ANSWER_TIMEOUT_S`` fails the replica's ``send`` with
``ConnectionError``, which breaks its channel: later outputs go through the handle calls and
the ingress fails over a stream that lost one (its ``seq`` gap).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
from collections.abc import Callable

from worker.outputs import OutputDelta, deltas_from_wire, deltas_to_wire

log = logging.getLogger("ray.serve")

TOKEN_BYTES = 16
MAX_FRAME_BYTES = 64 << 20
"""A batch larger than this is not one an engine step produces: the connection is closed."""
ANSWER_TIMEOUT_S = 30.0
"""How long a replica waits for the ingress to confirm a frame before giving the channel up."""
CONNECT_TIMEOUT_S = 5.0
_HEADER_BYTES = 4
_ANSWER = b"\x01"


class _PushProtocol(asyncio.Protocol):
    """One engine replica's connection, on the ingress: checks the token, then hands each
    frame's outputs to ``on_batch`` and answers it."""

    def __init__(
        self,
        token: bytes,
        on_batch: Callable[[list[OutputDelta]], None],
        live: set[asyncio.Transport],
    ) -> None:
        self._token = token
        self._on_batch = on_batch
        self._live = live
        self._buffer = bytearray()
        self._authorized = False
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._live.add(transport)

    def connection_lost(self, exc) -> None:
        self._live.discard(self._transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._authorized:
            if len(self._buffer) < TOKEN_BYTES:
                return
            if not hmac.compare_digest(bytes(self._buffer[:TOKEN_BYTES]), self._token):
                self._refuse("a connection with the wrong token")
                return
            self._authorized = True
            del self._buffer[:TOKEN_BYTES]
        while len(self._buffer) >= _HEADER_BYTES:
            size = int.from_bytes(self._buffer[:_HEADER_BYTES], "big")
            if size > MAX_FRAME_BYTES:
                self._refuse(f"a {size}-byte frame")
                return
            end = _HEADER_BYTES + size
            if len(self._buffer) < end:
                return
            payload = self._buffer[_HEADER_BYTES:end]  # the frame's one copy
            del self._buffer[:end]
            try:
                batch = deltas_from_wire(pickle.loads(payload))
            except Exception as exc:  # noqa: BLE001 - a peer that speaks something else
                self._refuse(f"a frame that does not decode ({exc!r})")
                return
            self._on_batch(batch)
            self._transport.write(_ANSWER)

    def _refuse(self, what: str) -> None:
        log.warning("push connection closed: %s", what)
        self._buffer.clear()
        self._transport.close()


class PushServer:
    """Where engine replicas push outputs to this ingress replica; ``address`` tells them."""

    def __init__(
        self, server: asyncio.Server, host: str, token: bytes, live: set[asyncio.Transport]
    ) -> None:
        self._server = server
        self.host = host
        self.port: int = server.sockets[0].getsockname()[1]
        self._token = token
        self._live = live

    @classmethod
    async def start(cls, on_batch: Callable[[list[OutputDelta]], None], host: str) -> PushServer:
        """Listens on ``host`` (this node's address as Ray knows it) at a free port;
        ``on_batch`` gets each frame's outputs, on this loop."""
        token = secrets.token_bytes(TOKEN_BYTES)
        live: set[asyncio.Transport] = set()
        server = await asyncio.get_running_loop().create_server(
            lambda: _PushProtocol(token, on_batch, live), host, 0
        )
        return cls(server, host, token, live)

    @property
    def address(self) -> dict:
        """What an engine replica needs to connect: ``{"host", "port", "token"}``."""
        return {"host": self.host, "port": self.port, "token": self._token.hex()}

    def close(self) -> None:
        """Stops listening and closes every engine replica's connection."""
        self._server.close()
        for transport in list(self._live):
            transport.close()

    async def wait_closed(self) -> None:
        await self._server.wait_closed()


class PushConnection:
    """An engine replica's connection to one ingress replica; ``send`` is its ``Deliver``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, address: dict) -> PushConnection:
        """Connects to the ingress at ``address`` (``PushServer.address``); raises
        ``OSError`` (or ``TimeoutError``) when it cannot be reached."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(address["host"], address["port"]), CONNECT_TIMEOUT_S
        )
        writer.write(bytes.fromhex(address["token"]))
        return cls(reader, writer)

    async def send(self, batch: list[OutputDelta]) -> None:
        """Sends ``batch`` as one frame and returns once the ingress confirmed it."""
        payload = pickle.dumps(deltas_to_wire(batch), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._writer.write(len(payload).to_bytes(_HEADER_BYTES, "big") + payload)
            await self._writer.drain()
            await asyncio.wait_for(self._reader.readexactly(1), ANSWER_TIMEOUT_S)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            self.close()
            raise ConnectionError(f"the ingress did not take a batch: {exc!r}") from exc

    def close(self) -> None:
        self._writer.close()
