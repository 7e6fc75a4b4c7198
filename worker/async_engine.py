"""``AsyncEngine``: the engine a server hosts. The engine steps elsewhere; asyncio callers stream
each request's ``OutputDelta``s (``worker/outputs.py``): what each step added, never the
whole answer again (``worker.outputs.accumulate`` adds them up for a caller that wants it).

Where the engine runs (``EngineCore``)
    ``ProcessCore`` (the default for one rank, ``worker/engine_process.py``): the
    ``LLMEngine`` and its busy loop live in a child process of their own, so the server's
    Python (asyncio streaming, Ray's threads, metrics) never competes with the engine loop
    for one GIL. Commands go down a socket; one message per engine step comes back with
    every request's new tokens, the replica stats and the KV events.
    ``ThreadCore``: the same loop in a thread of this process, for tensor parallelism under
    Ray (its worker launcher needs the replica actor's Ray context) and for ``spawn=False``.

Delivery
    A background thread receives each step's outputs and hands them to the callers' asyncio
    queues with one ``call_soon_threadsafe`` per event loop per step, not one per token.
    Callers never touch engine state, so a slow step never blocks the server's event loop and
    a request can be added or aborted at any time. A caller that relays a request's outputs
    elsewhere may hand ``generate`` a ``sink`` instead: it is called on the caller's loop in
    that same per-step callback, with no task woken per output; the request's last output
    and any error still come through ``generate``.

Failure model
    Bad input is rejected in ``generate`` (``ValueError``) before anything is queued. A full
    waiting queue raises ``EngineOverloadedError``. If a step raises, or the engine process
    dies, the engine is dead: every pending request ends with ``EngineDeadError``,
    ``is_alive()`` turns False and the replica's health check fails so Ray Serve replaces it.
    A caller that stops iterating (client gone) aborts its request and frees its blocks.
    Under tensor parallelism a dead worker rank makes the next step raise (the path above)
    and ``is_alive()`` False at once, even while idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from router.protocol import BlockHash, KVEventBatch, ReplicaStats
from worker.config import EngineConfig
from worker.engine_commands import Abort, Add, Call, Stop
from worker.engine_core import EngineCore, StepResult, ThreadCore
from worker.engine_process import ProcessCore
from worker.outputs import EngineDeadError, EngineOverloadedError, OutputDelta
from worker.request_checks import validate_request
from worker.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch and the engine's modules load in the engine's process
    from worker.kv_transfer import KVPayload
    from worker.parallel.workers import WorkerLauncher

log = logging.getLogger(__name__)

MAX_BUFFERED_KV_BATCHES = 10_000
"""Undrained KV event batches kept; older ones are dropped (the index resyncs on a seq gap)."""


Sink = Callable[[OutputDelta], bool]
"""Takes one output of a request (``AsyncEngine.generate``'s ``sink``); False hands it back."""


class _Stream:
    """Where one request's outputs go: the caller's loop and queue, or its ``sink``."""

    __slots__ = ("loop", "queue", "sink")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, sink: Sink | None
    ) -> None:
        self.loop = loop
        self.queue = queue
        self.sink = sink


class AsyncEngine:
    """``generate`` streams a request's ``OutputDelta``s; see the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        replica_id: str = "replica-0",
        launcher: WorkerLauncher | None = None,
        *,
        spawn: bool | None = None,
    ):
        """``spawn``: run the engine in its own process (default: whenever there is no
        ``launcher``, i.e. one rank or local tensor-parallel workers)."""
        if spawn is None:
            spawn = launcher is None
        self._core: EngineCore = (
            ProcessCore(config, replica_id) if spawn else ThreadCore(config, replica_id, launcher)
        )
        info = self._core.info
        self.config = config
        self.replica_id = replica_id
        self.model_id = info.model_id
        self.cache_namespace = info.cache_namespace
        self.max_model_len = info.max_model_len
        self.block_size = info.block_size
        self.tokenizer_vocab_size = info.tokenizer_vocab_size
        self.tokenizer_class = info.tokenizer_class
        self._streams: dict[str, _Stream] = {}
        self._kv_batches: deque[KVEventBatch] = deque(maxlen=MAX_BUFFERED_KV_BATCHES)
        self._stats = ReplicaStats()
        self._metrics: dict[str, float] = {"num_requests_waiting": 0}
        self._adds_sent = 0
        self._adds_handled = 0
        self._error: BaseException | None = None
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._core.start(self._on_step, self._on_dead, self._answer)

    # -- caller side -------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        resume_token_ids: Sequence[int] = (),
        lora_name: str | None = None,
        sink: Sink | None = None,
    ) -> AsyncIterator[OutputDelta]:
        """Streams the request's ``OutputDelta``s, several steps' in one when the caller
        reads slower than the engine steps; ``resume_token_ids`` continue a stream another
        replica began; ``lora_name`` picks a LoRA adapter (``LLMEngine.add_request``).

        ``sink``: takes each output that does not finish the request instead of this
        generator, called on this loop in the step's delivery callback; when it returns False
        (or raises), that output and every later one come through the generator again. The
        finishing output and any error always come through the generator."""
        if not self.is_alive():
            raise EngineDeadError(f"engine {self.replica_id} is not running: {self.why_dead()}")
        info = self._core.info
        validate_request(
            prompt_token_ids,
            params,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            kv_capacity_tokens=info.kv_capacity_tokens,
        )
        waiting = self._metrics.get("num_requests_waiting", 0) + (
            self._adds_sent - self._adds_handled
        )
        if waiting + params.n > self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"{waiting} requests waiting (limit {self.config.max_waiting_requests})"
            )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        out_q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = _Stream(asyncio.get_running_loop(), out_q, sink)
        self._adds_sent += 1
        self._core.submit(
            Add(
                request_id,
                list(prompt_token_ids),
                params,
                cache_salt,
                list(resume_token_ids),
                lora_name,
            )
        )
        finished = False
        try:
            while True:
                item = await out_q.get()
                while (
                    not isinstance(item, BaseException) and not item.finished and not out_q.empty()
                ):
                    later = out_q.get_nowait()  # a slow reader: send what piled up as one output
                    item = later if isinstance(later, BaseException) else item.extend(later)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.is_alive():
                self._core.submit(Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._core.submit(Abort(request_id))

    async def export_prefix(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        shared_dir: str | None = None,
        lora_name: str | None = None,
    ) -> KVPayload | None:
        """``LLMEngine.export_prefix``. An engine in its own process answers at once with
        its device blocks while it steps (``engine_core.answer_now``); otherwise, or with a
        host tier, it is run between two steps. ``shared_dir``: the importer is on this node
        (``kv_transfer.SharedKV``); ``lora_name``: the adapter whose KV it is."""
        return await self._call(
            "export_prefix", list(block_hashes), list(token_ids), cache_salt, shared_dir, lora_name
        )

    async def lora_adapters(self) -> dict[str, str]:
        """``LLMEngine.lora_adapters``: every adapter served, name -> folder."""
        return await self._call("lora_adapters")

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """``LLMEngine.load_lora_adapter``, between two steps; raises its refusals."""
        await self._call("load_lora_adapter", name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        """``LLMEngine.unload_lora_adapter``, between two steps; raises its refusals."""
        await self._call("unload_lora_adapter", name)

    async def import_prefix(self, payload: KVPayload) -> int:
        """``LLMEngine.import_prefix``, run by the engine between two steps; raises its refusals."""
        return await self.submit_import(payload)

    def submit_import(self, payload: KVPayload) -> asyncio.Future:
        """Queues ``import_prefix`` now and returns the future of its answer. The engine takes
        commands in order, so a request added after this call finds the imported blocks
        without waiting for the answer (which comes a step later)."""
        return self._start_call("import_prefix", payload)

    async def _call(self, method: str, *args) -> object:
        return await self._start_call(method, *args)

    def _start_call(self, method: str, *args) -> asyncio.Future:
        if not self.is_alive():
            raise EngineDeadError(f"engine {self.replica_id} is not running: {self.why_dead()}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (loop, future)
        future.add_done_callback(lambda _: self._calls.pop(call_id, None))
        self._core.submit(Call(call_id, method, args))
        if not self.is_alive():  # died before it could answer: _on_dead may have run already
            _settle(future, EngineDeadError(f"engine {self.replica_id} failed: {self.why_dead()}"))
        return future

    @property
    def tokenizer(self):
        """The engine's tokenizer (loaded in this process on first use by a process core)."""
        return self._core.tokenizer

    def stats(self) -> ReplicaStats:
        return self._stats

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def drain_kv_events(self) -> list[KVEventBatch]:
        out = []
        while self._kv_batches:
            out.append(self._kv_batches.popleft())
        return out

    def is_alive(self) -> bool:
        return self._error is None and self._core.is_alive()

    def dead_tp_ranks(self) -> list[int]:
        return self._core.dead_tp_ranks()

    def why_dead(self) -> str:
        """What ended the engine, for health checks and logs ("" while alive)."""
        if self._error is not None and self._core.is_alive():
            return f"engine failed: {self._error!r}"
        return self._core.why_dead()

    async def shutdown(self, drain_timeout_s: float = 5.0) -> None:
        """Let running requests finish for up to ``drain_timeout_s``, abort the rest, stop."""
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self.is_alive():
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        self._core.submit(Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._core.join, 10.0)

    # -- the core's thread -------------------------------------------------------------------
    def _on_step(self, result: StepResult) -> None:
        self._stats, self._metrics = result.stats, result.metrics
        self._adds_handled = result.adds_handled
        self._kv_batches.extend(result.kv_batches)
        for call_id, answer in result.replies:
            self._answer(call_id, answer)
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, exc in result.rejected:
            self._route(request_id, exc, deliveries)
        for out in result.outputs:
            self._route(out.request_id, out, deliveries)
        self._flush(deliveries)

    def _answer(self, call_id: int, answer: object) -> None:
        target = self._calls.pop(call_id, None)
        if target is not None:
            loop, future = target
            with contextlib.suppress(
                RuntimeError
            ):  # the caller's loop is closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, future, answer)

    def _on_dead(self, exc: BaseException) -> None:
        self._error = exc
        for call_id in list(self._calls):
            self._answer(call_id, EngineDeadError(f"engine {self.replica_id} failed: {exc!r}"))
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id in list(self._streams):
            self._route(
                request_id, EngineDeadError(f"engine {self.replica_id} failed: {exc!r}"), deliveries
            )
        self._flush(deliveries)

    def _route(self, request_id: str, item, deliveries: dict) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            deliveries.setdefault(stream.loop, []).append((stream, item))

    def _flush(self, deliveries: dict) -> None:
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                for _, item in items:
                    if isinstance(item, OutputDelta) and not item.finished:
                        self._core.submit(Abort(item.request_id))


def _settle(future: asyncio.Future, answer: object) -> None:
    if not future.done():
        if isinstance(answer, BaseException):
            future.set_exception(answer)
        else:
            future.set_result(answer)


def _put_all(items: list[tuple[_Stream, object]]) -> None:
    """On the streams' loop: each item to its stream's sink (``AsyncEngine.generate``) when it
    has one and the item is an output that does not finish the request, else to its queue."""
    for stream, item in items:
        sink = stream.sink
        if sink is not None and isinstance(item, OutputDelta) and not item.finished:
            try:
                if sink(item):
                    continue
            except Exception:  # a broken sink must not cost the other requests their outputs
                log.exception("the sink of request %s failed; streaming it", item.request_id)
            stream.sink = None
        stream.queue.put_nowait(item)
