"""Outputs pushed from an engine replica to an ingress replica, every request's in one frame.

Why: a Serve streaming call carries each item as a Ray object of its own, and at a GPU's token
rate that per-item cost, paid in the replica and again in the ingress, is most of what the
serving path costs per token. So ``EngineReplica.generate`` streams only a request's first
output and its last through its handle call (what the ingress needs to answer with the right
status, to fail over and to end the stream), and hands every output in between to the
``IngressChannel`` of the ingress replica that called it (``push_to``). A channel sends what
has piled up as one frame on its connection to that ingress (``cluster/push_socket.py``) and,
while the ingress has not confirmed it, gathers the next batch: at most one frame in flight per
(replica, ingress) pair, so deliveries keep their order, an idle channel sends a request's
output at once (no timer), and a busy one sends every request's outputs of one engine step, or
of several, in one frame.

Before a request's last output goes through the handle call, ``flushed`` waits until every
output pushed before it has been delivered, so the ingress sees a stream's items in order.

How it fails: an ingress that cannot be reached gets no channel (its requests stream through
their handle calls); a delivery that raises (the ingress replica is gone, or closed the
connection) breaks the channel: it is logged, what it held is dropped, waiters are released
and later pushes are refused (``push`` returns False), so ``generate`` streams through its
handle call again; the ingress, if it is alive, fails those requests' streams over by their
handle calls as for any lost stream. A new ingress replica, or the next request to one whose
channel broke, gets a new channel.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from worker.outputs import OutputDelta

log = logging.getLogger("ray.serve")

RETRY_CONNECT_S = 5.0
"""After a failed connect, requests to that ingress stream through their handle calls this
long before the next connect is tried."""

Deliver = Callable[[list[OutputDelta]], Awaitable[object]]
"""Sends one batch of outputs (any requests', in order) to the ingress and returns once it has
them: ``cluster.push_socket.PushConnection.send``."""


class IngressChannel:
    """Outputs for one ingress replica, delivered in order, one batch at a time."""

    def __init__(self, name: str, deliver: Deliver) -> None:
        self.name = name
        self._deliver = deliver
        self._pending: list[OutputDelta] = []
        self._pushed = 0
        self._delivered = 0
        self._progress = asyncio.Condition()
        self._wakeup = asyncio.Event()
        self.broken = False
        self.num_deliveries = 0
        self._task = asyncio.get_running_loop().create_task(self._run())

    def push(self, item: OutputDelta) -> bool:
        """Queues ``item`` for delivery; False once the channel is broken (stream it instead)."""
        if self.broken:
            return False
        self._pending.append(item)
        self._pushed += 1
        self._wakeup.set()
        return True

    async def flushed(self) -> None:
        """Returns once everything pushed so far was delivered, or the channel broke."""
        target = self._pushed
        async with self._progress:
            await self._progress.wait_for(lambda: self._delivered >= target or self.broken)

    async def _run(self) -> None:
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                batch, self._pending = self._pending, []
                if not batch:
                    continue
                await self._deliver(batch)
                self.num_deliveries += 1
                async with self._progress:
                    self._delivered += len(batch)
                    self._progress.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the ingress is gone: stream through handles
            log.warning(
                "channel to ingress %s broke: %r; streaming through handles", self.name, exc
            )
        self.broken = True
        self._pending.clear()
        async with self._progress:
            self._progress.notify_all()

    def close(self) -> None:
        self._task.cancel()


class IngressChannels:
    """One ``IngressChannel`` per ingress replica that pushes were asked for; ``connect``
    turns an ingress's address into its ``Deliver`` (``cluster.push_socket``: a connection
    to that replica's push server)."""

    def __init__(self, connect: Callable[[dict], Awaitable[Deliver]]) -> None:
        self._connect = connect
        self._channels: dict[str, IngressChannel] = {}
        self._unreachable_until_s: dict[str, float] = {}
        self._connecting: dict[str, asyncio.Future] = {}

    async def get(self, push_to: dict) -> IngressChannel | None:
        """The channel to ``push_to`` (``{"replica_id", "host", "port", "token"}``), connected
        on first use; None when the ingress cannot be reached (stream through the handle
        instead), and for ``RETRY_CONNECT_S`` after that without trying again."""
        key = push_to["replica_id"]
        channel = self._channels.get(key)
        if channel is not None and not channel.broken:
            return channel
        if self._unreachable_until_s.get(key, 0.0) > time.monotonic():
            return None
        pending = self._connecting.get(key)
        if pending is None:  # one connect per ingress, however many requests wait for it
            pending = self._connecting[key] = asyncio.ensure_future(self._open(key, push_to))
        return await asyncio.shield(pending)

    async def _open(self, key: str, push_to: dict) -> IngressChannel | None:
        try:
            deliver = await self._connect(push_to)
        except Exception as exc:  # noqa: BLE001 - no channel: the handle call carries the outputs
            log.warning("no channel to ingress %s: %r", key, exc)
            self._unreachable_until_s[key] = time.monotonic() + RETRY_CONNECT_S
            return None
        finally:
            self._connecting.pop(key, None)
        channel = self._channels[key] = IngressChannel(key, deliver)
        return channel

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
