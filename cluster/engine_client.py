"""Calls into the engine replicas: start engine requests, merge their streams, cancel them.

``EngineClient`` wraps the streaming ``DeploymentHandle`` of ``EngineReplica``. ``open_all``
starts one engine request per prompt (block hashes attached for the request router) and
awaits each first output, so refusals surface as ``APIError`` before the HTTP response
starts: Serve's full queue (``BackPressureError``) -> 429, the replica's own refusals
(``cluster.stream_items.Rejected``) -> 400/429/503/500, an unreachable replica -> 503. Each
first output is also reported to the ``router.load.LoadTracker`` the client was handed (the
one the request router of this process feeds): the request is past its prefill, no longer
in its replica's queue. With ``push_to`` the replica pushes every output of a call but the
last to this ingress replica's push server (``deliver``, one frame per engine step for every
request: ``cluster/ingress_channel.py``), the first included; each call's inbox gets them
and, behind them, what its handle stream carries (the last output or a refusal: ``EngineCall``),
in the replica's order.
``merge`` then yields ``(prompt index, [OutputDelta, ...])`` as outputs arrive (every output of
a stream that arrived while the caller was busy comes in one list, so a loaded ingress pays
its per-write costs once for them) and, when the caller stops early (client gone, a sibling
failed), cancels every stream not yet ended, which aborts the engine requests and frees their
blocks.

Stream failover: when the replica serving a stream dies mid-stream (its actor is gone, or its
engine died and it says so), ``merge`` re-submits the request to a live replica with the
tokens already streamed (``resume_token_ids``) and goes on from there. Outputs are
deterministic (greedy and seeded sampling are keyed by position, penalties and stop strings
see the same history), so the client's one stream holds the tokens a fault-free run gives;
its usage keeps the first replica's ``cached_tokens``. A replica that dies after its last
output (its stream's end still in flight) ends the stream normally. Up to
``MAX_FAILOVERS`` re-submissions per stream, ``FAILOVER_BACKOFF_S`` apart (doubling); after
that, or for ``n > 1`` requests, the error reaches the client as before. A request whose
first answer is a 503 (its replica's engine is dead, e.g. a tensor-parallel worker died, or
the replica is unreachable) is re-submitted the same way before the HTTP response starts:
nothing was streamed, so any live replica may start it.
"""

from __future__ import annotations

import asyncio
import enum
import logging

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from cluster import errors
from cluster.engine_call import END, EngineCall, Inbox
from cluster.errors import APIError
from cluster.serve_compat import own_internal_request_id
from cluster.stream_items import Rejected, RejectKind
from router.load import LoadTracker
from router.protocol import adapter_namespace, hash_blocks
from worker.outputs import OutputDelta
from worker.sampling_params import SamplingParams

# Serve routes the "ray.serve" logger into each replica's log file.
log = logging.getLogger("ray.serve")

MAX_FAILOVERS = 3
"""Re-submissions of one stream whose replica died; one more failure reaches the client."""
FAILOVER_BACKOFF_S = 0.5
"""Wait before the first re-submission (doubling after): Serve needs a moment to stop routing
to a dead replica."""


class _Event(enum.Enum):
    ITEM = "item"
    END = "end"
    FAILED = "failed"


class ReplicaDiedError(Exception):
    """The replica serving a stream is gone (or its engine is): the stream may fail over."""


class _Stream:
    """One engine request's stream and what the client has had of it so far."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        salt,
        first: OutputDelta,
        call: EngineCall,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_name = lora_name
        self.prompt_ids = prompt_ids
        self.params = params
        self.salt = salt
        self.first = first
        self.call = call
        self.num_cached_tokens = first.num_cached_tokens
        self.token_ids: list[int] = []
        """Output tokens streamed so far (choice 0; failover is for ``n == 1``)."""
        self.finished = False
        self.num_failovers = 0
        self._next_seq = 0

    def record(self, item: OutputDelta) -> OutputDelta:
        """Notes what ``item`` streams; after a failover, shows the first replica's cache hit.
        Raises ``ReplicaDiedError`` when an output of the call never arrived (a push lost
        with a broken channel): the stream fails over from what the client has."""
        if item.seq != self._next_seq:
            raise ReplicaDiedError(
                f"output {self._next_seq} of {self.call.request_id} was lost in transit"
            )
        self._next_seq += 1
        self.token_ids += item.new_token_ids
        self.finished = self.finished or item.finished
        if self.num_failovers:
            item.num_cached_tokens = self.num_cached_tokens
        return item

    def resumed_with(self, call: EngineCall) -> None:
        """The stream goes on in ``call`` (a failover): its outputs are numbered anew."""
        self.call = call
        self._next_seq = 0

    def can_fail_over(self) -> bool:
        return not self.finished and self.params.n == 1 and self.num_failovers < MAX_FAILOVERS


def _died(exc: BaseException) -> bool:
    return isinstance(exc, (RayActorError, ActorUnavailableError, ReplicaDiedError))


class EngineClient:
    """Streaming calls to ``EngineReplica.generate`` for one model."""

    def __init__(
        self,
        stream_handle,
        *,
        block_size: int,
        cache_namespace: str,
        push_to: dict | None = None,
        load: LoadTracker | None = None,
    ) -> None:
        """``push_to``: this ingress replica's push address (its ``replica_id`` and
        ``cluster.push_socket.PushServer.address``): the replicas push a call's outputs between
        its first and its last there, and the server hands them to ``deliver``
        (``cluster/ingress_channel.py``); None: every output comes through the handle call.
        ``cache_namespace``: what the replicas seed block hashes with (their ``describe``).
        ``load``: the tracker the handle's request router feeds (``cluster.router_context``),
        told each call's first output; None: nobody to tell."""
        self._stream_handle = stream_handle
        self.block_size = block_size
        self.cache_namespace = cache_namespace
        self.push_to = push_to
        self.load = load
        self._inboxes: dict[str, Inbox] = {}

    def deliver(self, batch: list[OutputDelta]) -> None:
        """Outputs a replica pushed, into their calls' inboxes; a call that ended already
        (cancelled, failed over) drops its outputs."""
        inboxes = self._inboxes
        for item in batch:
            inbox = inboxes.get(item.request_id)
            if inbox is not None:
                inbox.put(item)

    def _forget(self, call: EngineCall) -> None:
        if self._inboxes.get(call.request_id) is call.inbox:
            del self._inboxes[call.request_id]

    async def _open(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        salt,
        resume_token_ids: list[int] | None = None,
        lora_name: str | None = None,
    ):
        """Starts one engine request; returns (first output, its ``EngineCall``) or raises
        APIError. ``lora_name``: the LoRA adapter it runs on (None: the base model); its
        blocks hash in the adapter's namespace, as the engine hashes them."""
        namespace = adapter_namespace(self.cache_namespace, lora_name)
        hashes = hash_blocks(prompt_ids, self.block_size, namespace, salt)
        # This task's calls only (prompts of one request go in parallel). Serve's request
        # router sees the call only as a pending request keyed by this id, so the load
        # tracker knows it by this key too.
        routing_key = own_internal_request_id()
        call = None
        inbox = Inbox()
        self._inboxes[request_id] = inbox  # before the call: its outputs may be pushed first
        try:
            # Serve may refuse in remote() itself (its queue is full) or as the first item.
            response = self._stream_handle.generate.remote(
                request_id,
                prompt_ids,
                params,
                cache_salt=salt,
                block_hashes=hashes,
                resume_token_ids=resume_token_ids,
                push_to=self.push_to,
                lora_name=lora_name,
            )
            call = EngineCall(request_id, inbox, response)
            first = await call.first()
            if self.load is not None:
                self.load.first_output(routing_key)  # not queued or prefilling any more
        except BaseException as exc:
            if self._inboxes.get(request_id) is inbox:
                del self._inboxes[request_id]
            if call is not None:
                call.stop()
            if isinstance(exc, BackPressureError):
                raise errors.overloaded("too many queued requests") from None
            if isinstance(
                exc, (APIError, asyncio.CancelledError, GeneratorExit, KeyboardInterrupt)
            ):
                raise
            log.warning("request %s failed to start: %r", request_id, exc)
            raise errors.unavailable("no replica could take the request") from None
        if isinstance(first, Rejected):
            self.close(call)
            raise first.api_error()
        return first, call

    def close(self, call: EngineCall) -> None:
        """Ends ``call``: cancels its handle stream (aborting the engine request if it still
        runs) and drops its inbox."""
        self._forget(call)
        call.stop()

    async def open_all(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: list,
        salt,
        lora_name: str | None = None,
    ):
        """Starts every prompt's engine request at once, on LoRA adapter ``lora_name`` (None:
        the base model); on any failure cancels the rest."""
        sub_ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        results = await asyncio.gather(
            *(
                self._open_retrying(*call, salt, lora_name)
                for call in zip(sub_ids, prompts, params, strict=True)
            ),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for result in results:
                if not isinstance(result, BaseException):
                    self.close(result[2])
            raise failures[0]
        return [
            _Stream(sub_id, prompt, p, salt, first, call, lora_name)
            for prompt, p, (sub_id, first, call) in zip(prompts, params, results, strict=True)
        ]

    async def _open_retrying(self, request_id: str, prompt_ids, params, salt, lora_name=None):
        """``_open``, re-submitted while it fails with 503 (``MAX_FAILOVERS`` times, backing off
        like a failover): a replica whose engine died answers so until Serve's health check
        replaces it. Returns (the request id used, first output, its ``EngineCall``)."""
        sub_id, attempt = request_id, 0
        while True:
            try:
                opened = await self._open(sub_id, prompt_ids, params, salt, lora_name=lora_name)
                return (sub_id, *opened)
            except APIError as exc:
                if exc.status != 503 or attempt == MAX_FAILOVERS:
                    raise
                log.warning("request %s could not start (%s); re-submitting", sub_id, exc)
            await asyncio.sleep(FAILOVER_BACKOFF_S * 2**attempt)
            attempt += 1
            sub_id = f"{request_id}@open{attempt}"

    async def _fail_over(self, stream: _Stream, cause: BaseException) -> OutputDelta:
        """Re-submits ``stream`` with the tokens streamed so far; returns the new first output."""
        while True:
            stream.num_failovers += 1
            await asyncio.sleep(FAILOVER_BACKOFF_S * 2 ** (stream.num_failovers - 1))
            log.warning(
                "request %s: replica lost after %d tokens (%r); resuming on another (try %d)",
                stream.request_id,
                len(stream.token_ids),
                cause,
                stream.num_failovers,
            )
            try:
                first, call = await self._open(
                    f"{stream.request_id}@{stream.num_failovers}",
                    stream.prompt_ids,
                    stream.params,
                    stream.salt,
                    resume_token_ids=list(stream.token_ids),
                    lora_name=stream.lora_name,
                )
                stream.resumed_with(call)
                return first
            except APIError as exc:
                if exc.status != 503 or not stream.can_fail_over():
                    raise
                cause = exc

    @staticmethod
    def _accept(stream: _Stream, arrived: list) -> tuple[list, object]:
        """(the outputs of ``arrived`` (an inbox's items) ``stream`` takes, in order; what ends
        it there or None): ``END`` (the handle stream ended), the exception that ended the
        handle stream, a refusal of the replica (a dead one's as ``ReplicaDiedError``), or
        the ``ReplicaDiedError`` of an output lost in transit."""
        accepted = []
        for item in arrived:
            if item is END or isinstance(item, BaseException):
                return accepted, item
            if isinstance(item, Rejected):
                if item.kind is RejectKind.DEAD:
                    return accepted, ReplicaDiedError(item.message)
                return accepted, item
            try:
                accepted.append(stream.record(item))
            except ReplicaDiedError as exc:
                return accepted, exc
        return accepted, None

    async def _items(self, stream: _Stream, index: int = 0):
        """``(index, outputs)``: ``stream``'s outputs in order, from its first on, each list
        holding every output that had arrived when the reader asked (one when it keeps up,
        more when it falls behind, so a busy ingress writes them to the client at once).
        Fails over (``_fail_over``) while it may when its replica dies, and raises when it
        may not; a refusal mid-stream comes alone, last. Ends the engine call when the
        reader stops early (client gone) or on failure, and forgets its inbox either way.

        The inbox is read here, not through a generator of its own: each level between the
        inbox and the HTTP response is paid once per streamed token."""
        ended = False
        try:
            yield index, [stream.record(stream.first)]
            while not stream.finished:
                try:
                    inbox = stream.call.inbox
                    while True:
                        if not inbox.items:
                            await inbox.arrival()
                            continue
                        accepted, end = self._accept(stream, inbox.take_all())
                        if accepted:
                            yield index, accepted
                        if end is None:
                            continue
                        if end is END:
                            break
                        if isinstance(end, Rejected):
                            yield index, [end]  # the caller raises what it stands for
                            ended = True
                            return
                        raise end
                    break
                except Exception as exc:
                    if _died(exc) and stream.finished:
                        # It died after its last output (the stream's end was still in
                        # flight): the client has every token, nothing is lost.
                        log.info(
                            "request %s: replica lost after its last output: %r",
                            stream.request_id,
                            exc,
                        )
                        break
                    if not (_died(exc) and stream.can_fail_over()):
                        raise
                    self.close(stream.call)
                    first = await self._fail_over(stream, exc)
                    yield index, [stream.record(first)]
            ended = True
        finally:
            if not ended:  # the reader left, or the stream failed: abort the engine request
                stream.call.stop()
            self._forget(stream.call)

    def merge(self, opened: list[_Stream]):
        """An async iterator of (prompt index, outputs) from every stream as they arrive, each
        a list of one stream's outputs that arrived together, in order; raises on failure.

        A stream whose replica dies fails over (``_fail_over``) while it may. One stream (a
        request with one prompt) is read by the caller's task, with nothing between it and
        the inbox but ``_items``; several are pumped by a task each into one queue
        (``_merge_many``)."""
        if len(opened) == 1:
            return self._items(opened[0])
        return self._merge_many(opened)

    async def _merge_many(self, opened: list[_Stream]):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: _Stream) -> None:
            try:
                async for _, outputs in self._items(stream, index):
                    await queue.put((_Event.ITEM, index, outputs))
                await queue.put((_Event.END, index, None))
            except Exception as exc:
                await queue.put((_Event.FAILED, index, exc))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(opened)]
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
            for index, stream in enumerate(opened):
                if index not in ended:  # client gone or a sibling failed: abort the engine request
                    stream.call.stop()
                self._forget(stream.call)
