"""Where an engine runs and the loop that steps it: the interface ``AsyncEngine`` talks to.

``EngineLoop`` is the loop itself, with no thread or process: take commands
(``worker/engine_commands.py``: ``Add``, ``Abort``, ``Call``, ``Stop``), step the
``LLMEngine``, report a ``StepResult`` (each advanced request's ``OutputDelta``, refused adds,
replica stats, metrics, KV events). ``EngineCore`` is where that loop runs: ``ThreadCore`` here (a
thread of this process, which owns the engine), ``ProcessCore`` in
``worker/engine_process.py`` (a child process). Both call ``on_step`` once per step that
produced anything and ``on_dead`` once if the engine dies, from a background thread.

How it fails: a step that raises kills the loop; ``ThreadCore`` logs it, reports it through
``on_dead`` and ends any tensor-parallel workers; ``is_alive()`` turns False.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from router.protocol import KVEventBatch, ReplicaStats
from worker.config import EngineConfig
from worker.engine_commands import Abort, Add, Call, Command, Stop
from worker.outputs import EngineOverloadedError, OutputDelta, deltas_from_wire, deltas_to_wire

if TYPE_CHECKING:  # the engine's modules (torch, the model, the tokenizer) load where it runs
    from worker.engine import LLMEngine
    from worker.parallel.workers import WorkerLauncher
    from worker.step_outputs import LaunchedStep
    from worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05
"""How long the idle thread loop waits for a command before checking again."""

ENGINE_CALLS = frozenset(
    {
        "export_prefix",
        "import_prefix",
        "lora_adapters",
        "load_lora_adapter",
        "unload_lora_adapter",
    }
)
"""``LLMEngine`` methods a ``Call`` command may run between steps (KV pulled from a peer,
LoRA adapters listed, loaded and unloaded)."""


def answer_now(engine: LLMEngine, call: Call) -> tuple[object] | None:
    """A ``Call`` that needs no step boundary, answered on the caller's thread while
    the engine steps: ``(answer,)``, or None when the call must wait for a step boundary.

    One call qualifies: ``export_prefix`` on an engine without a host tier, answered with the
    device blocks (``LLMEngine.export_device_prefix``); a host tier is read between steps
    only. A peer's pull then waits for the copy, not for the holder's step (up to seconds on
    a busy CPU replica)."""
    if call.method != "export_prefix" or engine.has_host_tier:
        return None
    try:
        return (engine.export_device_prefix(*call.args),)
    except Exception as exc:  # noqa: BLE001 - bad input from a peer must not end the engine
        return (exc,)


@dataclass(frozen=True)
class EngineInfo:
    """What callers need to know of the engine without reaching into it."""

    model_id: str
    model_path: str
    max_model_len: int
    block_size: int
    vocab_size: int
    kv_capacity_tokens: int
    cache_namespace: str
    """What block hashes are seeded with (``router.protocol.cache_namespace``)."""
    tokenizer_vocab_size: int
    """Token ids the tokenizer knows (may differ from the model's ``vocab_size``)."""
    tokenizer_class: str
    """transformers' class of the tokenizer (``Tokenizer.backend_class``)."""


@dataclass
class StepResult:
    """One engine step as the core reports it."""

    outputs: list[OutputDelta]
    """What the step added to each request it advanced or ended (aborts included)."""
    rejected: list[tuple[str, BaseException]]
    """Adds the engine refused (request id, ``ValueError`` or ``EngineOverloadedError``)."""
    stats: ReplicaStats
    metrics: dict[str, float]
    """``EngineMetricsSnapshot.as_dict()``: what ``/metrics`` exports, by series name."""
    kv_batches: list[KVEventBatch]
    adds_handled: int
    """Adds the engine has taken off its command queue so far (accepted or refused)."""
    replies: list[tuple[int, object]] = field(default_factory=list)
    """Answers to ``Call`` commands: (call id, the method's result or the exception it
    raised)."""

    def __reduce__(self):
        # The engine process pickles one per step on its loop: the outputs go in their wire
        # form, a step's deltas in one pass (``deltas_to_wire``).
        return (
            _step_result_from_wire,
            (
                deltas_to_wire(self.outputs),
                self.rejected,
                self.stats,
                self.metrics,
                self.kv_batches,
                self.adds_handled,
                self.replies,
            ),
        )


def _step_result_from_wire(outputs: list[tuple], *rest) -> StepResult:
    return StepResult(deltas_from_wire(outputs), *rest)


class EngineCore:
    """Where the ``LLMEngine`` runs. ``on_step`` and ``on_dead`` are called from a background
    thread: once per step with outputs, and once if the engine dies."""

    info: EngineInfo
    tokenizer: Tokenizer

    def start(
        self,
        on_step: Callable[[StepResult], None],
        on_dead: Callable[[BaseException], None],
        on_reply: Callable[[int, object], None] | None = None,
    ) -> None:
        """``on_reply(call id, answer)``: a call answered outside a step (``answer_now``)."""
        raise NotImplementedError

    def submit(self, command: Command) -> None:
        """Queues a command for the loop; a ``Call`` is answered in ``StepResult.replies``
        (or through ``on_reply``)."""
        raise NotImplementedError

    def is_alive(self) -> bool:
        raise NotImplementedError

    def why_dead(self) -> str:
        raise NotImplementedError

    def dead_tp_ranks(self) -> list[int]:
        return []

    def join(self, timeout_s: float) -> None:
        """Waits for the core to end after ``Stop``; forces it past ``timeout_s``."""
        raise NotImplementedError


def info_of(engine: LLMEngine) -> EngineInfo:
    return EngineInfo(
        engine.model_id,
        engine.model_path,
        engine.max_model_len,
        engine.block_size,
        engine.spec.vocab_size,
        engine.pool.num_blocks * engine.block_size,
        engine.cache_namespace,
        engine.tokenizer.vocab_size,
        engine.tokenizer.backend_class,
    )


class EngineLoop:
    """The loop both cores run: take commands, step, report. No threads or processes here.

    With ``LLMEngine.overlaps_outputs`` a step is split around the device's work: ``step``
    samples the step launched last time, launches the next one, and only then decodes the
    sampled tokens' text and reports them, so that this, the stats, the report's pickling and
    sending, and the commands taken before the next ``step`` all run while the device computes.
    The next step is scheduled after the sampled step's stop checks, so it never runs a
    finished sequence; a request aborted while its step is in flight gets nothing from it
    (``LLMEngine.sample_step``). At most one step is in flight."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.overlap = engine.overlaps_outputs
        self._in_flight: LaunchedStep | None = None
        self.adds_handled = 0
        self._aborted: list[OutputDelta] = []
        self._rejected: list[tuple[str, BaseException]] = []
        self._replies: list[tuple[int, object]] = []

    def handle(self, command: Command) -> bool:
        """Applies one command; False for ``Stop``."""
        match command:
            case Add():
                self.adds_handled += 1
                try:
                    self.engine.add_request(
                        command.request_id,
                        command.prompt_token_ids,
                        command.params,
                        command.cache_salt,
                        command.resume_token_ids,
                        command.lora_name,
                    )
                except (ValueError, EngineOverloadedError) as exc:
                    self._rejected.append((command.request_id, exc))
            case Abort():
                out = self.engine.abort_delta(command.request_id)
                if out is not None:
                    self._aborted.append(out)
            case Call():
                self._replies.append((command.call_id, self._call(command.method, command.args)))
            case Stop():
                return False
            case _:
                raise TypeError(f"not an engine command: {command!r}")
        return True

    def _call(self, method: str, args: tuple) -> object:
        """Runs an ``ENGINE_CALLS`` method; what it raises is the caller's answer, never the
        loop's end."""
        if method not in ENGINE_CALLS:
            return ValueError(f"method: {method!r} is not one of {sorted(ENGINE_CALLS)}")
        try:
            return getattr(self.engine, method)(*args)
        except Exception as exc:  # noqa: BLE001 - bad input from a peer must not end the engine
            return exc

    def step(self) -> StepResult | None:
        """One engine step (if anything is runnable); None when there is nothing to report.
        The stats are stamped with the step's start (``ReplicaStats.as_of_s``): every request
        added before it is in them."""
        started_at_s = time.time()
        outputs = self._aborted + self._step_outputs()
        kv_batches = self.engine.drain_kv_events()
        if not (outputs or self._rejected or kv_batches or self._replies):
            return None
        result = StepResult(
            outputs,
            self._rejected,
            replace(self.engine.stats(), as_of_s=started_at_s),
            self.engine.metrics_snapshot().as_dict(),
            kv_batches,
            self.adds_handled,
            self._replies,
        )
        self._aborted, self._rejected, self._replies = [], [], []
        return result

    def _step_outputs(self) -> list[OutputDelta]:
        engine = self.engine
        if not self.overlap:
            return engine.step_deltas() if engine.has_unfinished() else []
        in_flight, self._in_flight = self._in_flight, None
        advanced, self._in_flight = engine.advance_overlapped(in_flight)
        return engine.deltas_of(advanced)

    def idle(self) -> bool:
        return (
            self._in_flight is None
            and not self.engine.has_unfinished()
            and not self._aborted
            and not self._rejected
            and not self._replies
        )


class ThreadCore(EngineCore):
    """The engine in this process, stepped by one thread that owns it."""

    def __init__(
        self, config: EngineConfig, replica_id: str, launcher: WorkerLauncher | None
    ) -> None:
        from worker.engine import LLMEngine

        self.engine = LLMEngine(config, replica_id, launcher)
        self.info = info_of(self.engine)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"engine-{replica_id}", daemon=True)

    def start(self, on_step, on_dead, on_reply=None) -> None:
        """Every call is answered between steps, in ``StepResult.replies`` (this core serves
        tensor parallelism, where KV transfer is refused)."""
        self._on_step, self._on_dead = on_step, on_dead
        self._thread.start()

    def submit(self, command: Command) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self.engine.dead_tp_ranks()

    def dead_tp_ranks(self) -> list[int]:
        return self.engine.dead_tp_ranks()

    def why_dead(self) -> str:
        dead_ranks = self.engine.dead_tp_ranks()
        if dead_ranks:
            return f"tensor-parallel worker rank(s) {dead_ranks} ended"
        if self._error is not None:
            return f"engine loop failed: {self._error!r}"
        return "" if self._thread.is_alive() else "engine loop stopped"

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        loop = EngineLoop(self.engine)
        try:
            while True:
                try:
                    command = (
                        self._commands.get(timeout=IDLE_POLL_S)
                        if loop.idle()
                        else self._commands.get_nowait()
                    )
                    if not loop.handle(command):
                        return
                    while True:
                        if not loop.handle(self._commands.get_nowait()):
                            return
                except queue.Empty:
                    pass
                result = loop.step()
                if result is not None:
                    self._on_step(result)
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            log.exception("engine %s loop died", self.engine.replica_id)
            self._error = exc
            self._on_dead(exc)
        finally:
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - ending workers is best effort; their parent's exit ends them too
                log.exception(
                    "engine %s: stopping tensor-parallel workers failed", self.engine.replica_id
                )
