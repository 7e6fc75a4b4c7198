"""Calls into the engine replicas: start engine requests, merge their streams, cancel them.

``EngineClient`` wraps the streaming ``DeploymentHandle`` of ``EngineReplica``. ``open_all``
starts one engine request per prompt (block hashes attached for the request router) and
awaits each first output, so refusals surface as ``APIError`` before the HTTP response
starts: Serve's full queue (``BackPressureError``) -> 429, the replica's own refusals
(``{"rejected": ...}``) -> 400/429/503/500, an unreachable replica -> 503. ``merge`` then
yields ``(prompt index, output dict)`` as outputs arrive and, when the caller stops early
(client gone, a sibling failed), cancels every stream not yet ended, which aborts the engine
requests and frees their blocks.
"""

from __future__ import annotations

import asyncio
import enum
import logging

from ray.serve.exceptions import BackPressureError

from cluster import errors
from cluster.errors import APIError
from router.protocol import hash_blocks
from worker.sampling_params import SamplingParams

# Serve routes the "ray.serve" logger into each replica's log file.
log = logging.getLogger("ray.serve")


class _Event(enum.Enum):
    ITEM = "item"
    END = "end"
    FAILED = "failed"


def _cancel_quietly(response) -> None:
    """Cancels a handle call; one that already failed or finished has nothing to cancel.

    ``cancel()`` re-raises the call's own error (e.g. ``BackPressureError``) when the call
    already failed, which must not replace the error the client gets.
    """
    try:
        response.cancel()
    except Exception as exc:
        log.debug("cancel of a finished handle call: %r", exc)


def rejection_error(rejected: dict) -> APIError:
    kind, message = rejected["kind"], rejected["message"]
    if kind == "invalid":
        return errors.from_value_error(ValueError(message))
    if kind == "overloaded":
        return errors.overloaded("engine queue full")
    if kind == "dead":
        return errors.unavailable(f"replica unavailable: {message}")
    return errors.internal(message)


def check_item(item: dict) -> None:
    """Raises the APIError a mid-stream replica output stands for, if any."""
    if "rejected" in item:
        raise rejection_error(item["rejected"])
    if item.get("error"):
        raise errors.internal(f"the engine failed this request: {item['error']}")


class EngineClient:
    """Streaming calls to ``EngineReplica.generate`` for one model."""

    def __init__(self, stream_handle, *, block_size: int, model_id: str) -> None:
        self._stream_handle = stream_handle
        self.block_size = block_size
        self.model_id = model_id

    async def _open(self, request_id: str, prompt_ids: list[int], params: SamplingParams, salt):
        """Starts one engine request; returns (first output, response) or raises APIError."""
        hashes = hash_blocks(prompt_ids, self.block_size, self.model_id, salt)
        response = None
        try:
            # Serve may refuse in remote() itself (its queue is full) or on the first item.
            response = self._stream_handle.generate.remote(
                request_id, prompt_ids, params, cache_salt=salt, block_hashes=hashes
            )
            first = await response.__anext__()
        except BaseException as exc:
            if response is not None:
                _cancel_quietly(response)
            if isinstance(exc, BackPressureError):
                raise errors.overloaded("too many queued requests") from None
            if isinstance(
                exc, (APIError, asyncio.CancelledError, GeneratorExit, KeyboardInterrupt)
            ):
                raise
            log.warning("request %s failed to start: %r", request_id, exc)
            raise errors.unavailable("no replica could take the request") from None
        if "rejected" in first:
            _cancel_quietly(response)
            raise rejection_error(first["rejected"])
        return first, response

    async def open_all(self, request_id: str, prompts: list[list[int]], params: list, salt):
        """Starts every prompt's engine request at once; on any failure cancels the rest."""
        sub_ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        results = await asyncio.gather(
            *(self._open(*call, salt) for call in zip(sub_ids, prompts, params, strict=True)),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for result in results:
                if not isinstance(result, BaseException):
                    _cancel_quietly(result[1])
            raise failures[0]
        return results

    @staticmethod
    async def merge(opened: list):
        """(prompt index, output dict) from every stream as they arrive; raises on failure."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, first: dict, response) -> None:
            try:
                await queue.put((_Event.ITEM, index, first))
                async for item in response:
                    await queue.put((_Event.ITEM, index, item))
                await queue.put((_Event.END, index, None))
            except Exception as exc:
                await queue.put((_Event.FAILED, index, exc))

        tasks = [
            asyncio.create_task(pump(i, first, resp)) for i, (first, resp) in enumerate(opened)
        ]
        ended: set[int] = set()
        try:
            while len(ended) < len(tasks):
                event, index, payload = await queue.get()
                if event is _Event.END:
                    ended.add(index)
                elif event is _Event.FAILED:
                    raise payload
                else:
                    yield index, payload
        finally:
            for task in tasks:
                task.cancel()
            for index, (_, response) in enumerate(opened):
                if index not in ended:  # client gone or a sibling failed: abort the engine request
                    _cancel_quietly(response)
