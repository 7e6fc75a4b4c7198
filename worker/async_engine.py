"""``AsyncEngine``: the engine a server hosts. A background thread steps; asyncio callers stream.

Threading model
    One loop thread owns the ``LLMEngine``: it drains a command queue (add / abort), runs a
    step, and hands each ``RequestOutput`` to the caller's asyncio queue with
    ``call_soon_threadsafe``. Callers never touch engine state, so a slow step never blocks the
    server's event loop and a request can be added or aborted at any time.

Failure model
    Bad input is rejected in ``generate`` (``ValueError``) before anything is queued. A full
    waiting queue raises ``EngineOverloadedError``. If a step itself raises, the engine is
    dead: every pending request ends with ``EngineDeadError``, ``is_alive()`` turns False and
    the replica's health check fails so Ray Serve replaces it. A caller that stops iterating
    (client gone) aborts its request and frees its blocks. Under tensor parallelism a dead
    worker rank makes the next step raise (the path above) and ``is_alive()`` False at once,
    even while idle; the loop thread ends the remaining workers when it exits.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

from router.protocol import KVEventBatch, ReplicaStats
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.outputs import EngineDeadError, EngineOverloadedError, RequestOutput
from worker.parallel.workers import WorkerLauncher
from worker.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05
"""How long the idle loop waits for a command before checking for shutdown again."""
MAX_BUFFERED_KV_BATCHES = 10_000
"""Undrained KV event batches kept; older ones are dropped (the index resyncs on a seq gap)."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, replica_id: str = "replica-0", launcher: WorkerLauncher | None = None):
        self.engine = LLMEngine(config, replica_id, launcher)
        self.config = config
        self.replica_id = replica_id
        self.model_id = self.engine.model_id
        self.max_model_len = self.engine.max_model_len
        self.block_size = self.engine.block_size
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._kv_batches: deque[KVEventBatch] = deque(maxlen=MAX_BUFFERED_KV_BATCHES)
        self._stats = self.engine.stats()
        self._metrics = self.engine.metrics_snapshot()
        self._pending_adds = 0
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{replica_id}", daemon=True)
        self._thread.start()

    # -- caller side -------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_alive():
            raise EngineDeadError(f"engine {self.replica_id} is not running: {self.why_dead()}")
        self.engine.validate(prompt_token_ids, params)
        waiting = self._metrics["num_requests_waiting"] + self._pending_adds
        if waiting + params.n > self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{waiting} requests waiting (limit {self.config.max_waiting_requests})")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        out_q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, out_q)
        self._pending_adds += params.n
        self._commands.put(("add", request_id, list(prompt_token_ids), params, cache_salt))
        finished = False
        try:
            while True:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

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
        return self._thread.is_alive() and self._error is None and not self.engine.dead_tp_ranks()

    def why_dead(self) -> str:
        """What ended the engine, for health checks and logs ("" while alive)."""
        dead_ranks = self.engine.dead_tp_ranks()
        if dead_ranks:
            return f"tensor-parallel worker rank(s) {dead_ranks} ended"
        if self._error is not None:
            return f"engine loop failed: {self._error!r}"
        return "" if self._thread.is_alive() else "engine loop stopped"

    async def shutdown(self, drain_timeout_s: float = 5.0) -> None:
        """Let running requests finish for up to ``drain_timeout_s``, abort the rest, stop."""
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self.is_alive():
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        self._commands.put(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # -- loop thread -------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, out_q = target
            try:
                loop.call_soon_threadsafe(out_q.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                self._commands.put(("abort", request_id))

    def _handle(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "stop":
            return False
        if kind == "add":
            _, rid, ids, params, salt = cmd
            self._pending_adds -= params.n
            if rid not in self._streams:  # the caller gave up before we got to it
                return True
            try:
                self.engine.add_request(rid, ids, params, salt)
            except (ValueError, EngineOverloadedError) as exc:
                self._deliver(rid, exc)
        elif kind == "abort":
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._deliver(cmd[1], out)
        return True

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished()
                try:
                    cmd = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
                    if not self._handle(cmd):
                        break
                    while True:
                        if not self._handle(self._commands.get_nowait()):
                            return
                except queue.Empty:
                    pass
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                self._kv_batches.extend(self.engine.drain_kv_events())
                self._stats = self.engine.stats()
                self._metrics = self.engine.metrics_snapshot()
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            log.exception("engine %s loop died", self.replica_id)
            self._error = exc
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine {self.replica_id} failed: {exc!r}"))
        finally:
            self._stop.set()
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - ending workers is best effort; their parent's exit ends them too
                log.exception("engine %s: stopping tensor-parallel workers failed", self.replica_id)
