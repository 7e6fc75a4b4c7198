"""One engine call as the ingress sees it: its handle stream and its inbox.

``EngineCall`` starts a task that copies the Serve handle stream of ``EngineReplica.generate``
into the call's ``Inbox``, where the outputs the replica pushed over the push connection
(``EngineClient.deliver``) also arrive, so the inbox holds the call's outputs in the
replica's order, then ``END`` or the exception that ended the handle stream.
``cluster/engine_client.py`` reads the inbox (``EngineClient._items``).

How it fails: never raises on its own; what ended the handle stream is put into the inbox for
the reader, and ``stop`` cancels a call that already failed or finished quietly.
"""

from __future__ import annotations

import asyncio
import collections
import logging

log = logging.getLogger("ray.serve")


def _cancel_quietly(response) -> None:
    """Cancels a handle call; one that already failed or finished has nothing to cancel.

    ``cancel()`` re-raises the call's own error (e.g. ``BackPressureError``) when the call
    already failed, which must not replace the error the client gets.
    """
    try:
        response.cancel()
    except Exception as exc:
        log.debug("cancel of a finished handle call: %r", exc)


END = object()
"""Put into a call's inbox when its handle stream ended."""


class Inbox:
    """What arrived for one engine call, in order, and the one reader waiting for more.

    An ``asyncio.Queue`` would do, at several times the cost per output: its ``get`` is a
    coroutine with a loop of its own, where a streamed token needs an append and, when the
    reader waits, one future set."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def arrival(self) -> asyncio.Future:
        """A future done at the next ``put`` (for the one reader, when ``items`` is empty)."""
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def take_all(self) -> list:
        items = list(self.items)
        self.items.clear()
        return items


class EngineCall:
    """One engine call as the ingress sees it: its handle stream and its inbox, where the
    outputs the replica pushed (``EngineClient.deliver``) and, behind them, what the handle
    stream carries (its last output, a refusal, ``END`` or the exception that ended it)
    arrive in the replica's order. A task copies the handle stream into the inbox from the
    start, so the first output is whichever comes first."""

    def __init__(self, request_id: str, inbox: Inbox, response) -> None:
        self.request_id = request_id
        self.inbox = inbox
        self.response = response
        self._watcher = asyncio.create_task(self._watch())

    async def first(self):
        """The call's first output (or ``Rejected``); raises what ended the handle stream
        before it."""
        inbox = self.inbox
        while not inbox.items:
            await inbox.arrival()
        item = inbox.items.popleft()
        if item is END:
            raise ConnectionError(f"the replica ended {self.request_id} without an output")
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Cancels the handle call (aborting the engine request if it still runs) and stops
        copying it."""
        self._watcher.cancel()
        _cancel_quietly(self.response)

    async def _watch(self) -> None:
        try:
            async for item in self.response:
                self.inbox.put(item)
        except Exception as exc:
            self.inbox.put(exc)
        else:
            self.inbox.put(END)
