"""The engine in a process of its own (``ProcessCore``), and that process's main.

Why: a server's event loop, Ray's threads and the metrics all run Python in the replica's
process. Sharing one GIL with them, the engine loop waited for the GIL after every torch op
(measured: a served batch of 8 ran at about half the offline engine's tokens/s). Here the
``LLMEngine`` and its loop (``EngineLoop``) own a child process, as vLLM v1's engine core does.

Protocol, over one ``socket.socketpair`` wrapped in ``multiprocessing.connection``:
    parent -> child: ``("init", EngineConfig, replica_id)``, then the commands themselves
    (``worker/engine_commands.py``: ``Add``, ``Abort``, ``Call``, ``Stop``; a ``Call`` is
    answered in the step's replies).
    child -> parent: ``("ready", EngineInfo)`` or ``("failed", message)`` once, then one
    ``("step", StepResult)`` per engine step that produced anything, ``("reply", (call id,
    answer))`` for a call answered at once (``engine_core.answer_now``: a peer's export), and
    ``("error", message)`` if the loop dies. Outputs travel as the engine made them,
    ``OutputDelta``s (new token ids, new text, new logprobs), passed on untouched: a step's
    message grows with the batch, not with the length of the outputs.

A peer's export (``engine_core.answer_now``) goes down a second socket, read in the child by
a thread of its own that answers it while the engine steps; its reply comes back on the first
socket, both child threads sending under one lock. Every other command stays on the first
socket, which the loop reads between steps as it always did (a reader thread feeding the loop
a queue raised the served TTFT p50 from about 510 to about 690 ms at concurrency 8: a burst
of adds reached the loop one step at a time). An engine with a host tier gets its exports on
the first socket, between steps.

The child is started with ``python -m worker.engine_process FD CALL_FD``: a fresh interpreter that
never re-imports the caller's ``__main__`` (so it works from Ray workers and plain scripts),
with the parent's ``sys.path`` and environment (thread counts, CUDA devices).

The child first claims CPUs of its own when ``EngineConfig.claim_cpus`` allows
(``cpus_to_claim``, ``worker/cpu_claims.py``: pinned to cores the node's serving processes keep
off, granted only while others stay for them), then asks for ``EngineConfig.engine_nice``
before it builds the engine (its threads inherit both): the engine loop bounds the replica's
token rate, so where it shares cores with the processes relaying its tokens it should run
first. Without ``CAP_SYS_NICE`` the request
is refused, logged, and the child runs at the priority it inherited.

How it fails: a child that dies while starting raises ``RuntimeError`` with its exit code
(its traceback is in its stderr, which is the parent's). A child that dies later, or whose
loop raises, makes the core dead: ``on_dead`` fires once and ``is_alive()`` turns False. The
child ends when its socket closes (the parent died or stopped it), so it never outlives the
replica; ``join`` kills it if it does not end in time.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

from worker import cpu_claims
from worker.config import EngineConfig, resolve_device, resolve_engine_nice
from worker.engine_commands import Call, Command
from worker.engine_core import EngineCore, EngineInfo, EngineLoop, answer_now, info_of
from worker.outputs import EngineDeadError

log = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 << 20
"""Send and receive buffer of each end of the engine socket (the kernel may grant less). A KV
payload (23 MB for a 496-token SmolLM2 prefix) then crosses in a few reads, not a hundred:
the reading thread takes the GIL back after each read, behind the server's busy threads."""
ENGINE_SWITCH_INTERVAL_S = 0.001
"""The engine process's GIL switch interval (Python's default: 5 ms). Its reader thread asks
for the GIL only when a command arrives; then it waits at most this long behind the loop."""
ENGINE_START_TIMEOUT_S = 900.0
"""Loading a model (a first GGUF conversion included) on a busy node."""
START_POLL_S = 0.5


def child_env() -> dict[str, str]:
    """The parent's environment with its ``sys.path`` as ``PYTHONPATH``, so a worker imports
    the same code (an editable install, a checkout, the script's own folder)."""
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        **cpu_claims.node_cpus_env(),
    }


class ProcessCore(EngineCore):
    """Starts the engine process, sends it commands, and receives its steps on a thread."""

    def __init__(self, config: EngineConfig, replica_id: str) -> None:
        self.replica_id = replica_id
        parent_sock, child_sock = socket.socketpair()
        parent_calls, child_calls = socket.socketpair()
        for sock in (parent_sock, child_sock):
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        fds = (child_sock.fileno(), child_calls.fileno())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "worker.engine_process", *map(str, fds)],
            pass_fds=fds,
            env=child_env(),
        )
        child_sock.close()
        child_calls.close()
        self._conn = Connection(parent_sock.detach())
        self._calls = Connection(parent_calls.detach())
        self._calls_lock = threading.Lock()
        self._export_at_once = config.host_kv_cache_bytes is None
        """Exports go down ``_calls`` (answered while the engine steps) unless a host tier,
        read between steps only, may hold part of the prefix."""
        self._send_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _end_process, self._proc, self._conn, self._calls)
        self._send(("init", config, replica_id))
        self.info = self._wait_ready()
        self._config = config
        self._tokenizer = None
        self._dead_reason = ""
        self._reader = threading.Thread(
            target=self._read, name=f"engine-reader-{replica_id}", daemon=True
        )

    @property
    def tokenizer(self):
        """The engine's tokenizer, loaded in this process on first use (a server that only
        relays requests never loads it, nor the libraries behind it)."""
        if self._tokenizer is None:
            from worker.loader import load_tokenizer

            self._tokenizer = load_tokenizer(
                self._config, model_path=self.info.model_path, chat_template=False
            )
        return self._tokenizer

    def _wait_ready(self) -> EngineInfo:
        deadline_s = time.monotonic() + ENGINE_START_TIMEOUT_S
        while time.monotonic() < deadline_s:
            if self._conn.poll(START_POLL_S):
                try:
                    kind, payload = self._conn.recv()
                except EOFError:
                    break
                if kind == "ready":
                    return payload
                self._finalizer()
                raise RuntimeError(
                    f"engine process of {self.replica_id} failed to start: {payload}"
                )
            if self._proc.poll() is not None:
                break
        self._finalizer()
        code = self._proc.poll()
        why = (
            f"exited with code {code}"
            if code is not None
            else f"not ready in {ENGINE_START_TIMEOUT_S:.0f}s"
        )
        raise RuntimeError(f"engine process of {self.replica_id} {why}; see its log above")

    def start(self, on_step, on_dead, on_reply=None) -> None:
        self._on_step, self._on_dead, self._on_reply = on_step, on_dead, on_reply
        self._reader.start()

    def submit(self, command: Command) -> None:
        try:
            if (
                self._export_at_once
                and isinstance(command, Call)
                and command.method == "export_prefix"
            ):
                with self._calls_lock:
                    self._calls.send(command)
            else:
                self._send(command)
        except OSError:  # the process is gone; the reader thread reports it
            pass

    def _send(self, message: object) -> None:
        with self._send_lock:
            self._conn.send(message)

    def is_alive(self) -> bool:
        return self._reader.is_alive() and self._proc.poll() is None and not self._dead_reason

    def why_dead(self) -> str:
        if self._dead_reason:
            return self._dead_reason
        code = self._proc.poll()
        return "" if code is None else f"engine process exited with code {code}"

    def join(self, timeout_s: float) -> None:
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "engine process of %s did not stop in %.0fs; killing it", self.replica_id, timeout_s
            )
        self._finalizer()
        self._reader.join(timeout_s)

    def _read(self) -> None:
        reason = ""
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "step":
                    self._on_step(payload)
                elif kind == "reply" and self._on_reply is not None:
                    self._on_reply(*payload)
                elif kind == "error":
                    reason = f"engine loop failed: {payload}"
                    break
        except (EOFError, OSError):
            code = self._proc.wait()
            reason = (
                "engine process stopped" if code == 0 else f"engine process exited with code {code}"
            )
        except Exception as exc:  # noqa: BLE001 - a message we cannot read: the engine is lost to us
            log.exception("engine %s: reading its process failed", self.replica_id)
            reason = f"reading the engine process failed: {exc!r}"
            self._finalizer()
        self._dead_reason = reason
        self._on_dead(EngineDeadError(reason))


def _end_process(proc: subprocess.Popen, conn: Connection, calls: Connection) -> None:
    """Closes the sockets (the child ends when it sees them closed), then makes sure it did."""
    conn.close()
    calls.close()
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- the child -------------------------------------------------------------------------------
def engine_nice_of(config: EngineConfig) -> int | None:
    """The nice value this engine asks for (``EngineConfig.engine_nice``, ``auto`` resolved
    from its device and torch threads against the cores this process may use)."""
    if config.engine_nice != "auto":  # nothing to probe
        return config.engine_nice
    import torch

    device = resolve_device(config.device, torch.cuda.is_available())
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    num_threads = config.num_threads or torch.get_num_threads()
    return resolve_engine_nice(config.engine_nice, device, num_threads, num_cores)


def cpus_to_claim(config: EngineConfig) -> int:
    """How many CPUs this engine claims for itself (``EngineConfig.claim_cpus`` allowing): one
    for the simulated engine's loop, its torch threads for a CPU engine that sets them; none
    for a CUDA engine, one whose torch threads span every core, or a tensor-parallel one."""
    if config.claim_cpus < 1 or config.tensor_parallel_size > 1:
        return 0
    if config.engine == "sim":
        needed = 1
    else:
        import torch

        if resolve_device(config.device, torch.cuda.is_available()) != "cpu":
            return 0
        needed = config.num_threads or 0
    return needed if needed <= config.claim_cpus else 0


def ask_for_priority(nice: int | None) -> int:
    """Sets this thread's nice value to ``nice`` (threads started later inherit it) when that
    is lower than what it runs at, and logs the outcome; returns the nice value it runs at.
    A refusal (no ``CAP_SYS_NICE``) keeps the inherited one."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice is None or nice >= current:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        log.warning(
            "engine process stays at nice %d: nice %d needs CAP_SYS_NICE (engine_nice)",
            current,
            nice,
        )
        return current
    log.info("engine process runs at nice %d (was %d; engine_nice)", nice, current)
    return nice


def serve_engine(conn: Connection, calls: Connection | None = None) -> int:
    """The engine process's life: build the engine, then run the loop until told to stop;
    ``calls`` (exports answered while the engine steps) is served by a thread of its own."""
    from worker.engine import LLMEngine

    _, config, replica_id = conn.recv()
    # Before the engine starts its threads: the claim pins every thread this process has, and
    # threads started later inherit the CPUs and the priority. The claim is held until exit.
    _claim = cpu_claims.claim_cpus(cpus_to_claim(config))
    ask_for_priority(engine_nice_of(config))
    try:
        engine = LLMEngine(config, replica_id)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        log.exception("engine %s failed to start", replica_id)
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", info_of(engine)))
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    if calls is not None:
        threading.Thread(
            target=answer_calls, args=(calls, engine, send), name="engine-calls", daemon=True
        ).start()
    loop = EngineLoop(engine)
    try:
        while True:
            timeout_s = None if loop.idle() else 0.0
            while conn.poll(timeout_s):
                if not loop.handle(conn.recv()):
                    return 0
                timeout_s = 0.0
            result = loop.step()
            if result is not None:
                send(("step", result))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the parent went away: nobody is left to serve
    except Exception as exc:  # noqa: BLE001 - the engine is dead; say why, then exit
        log.exception("engine %s loop died", replica_id)
        send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        engine.shutdown()


def answer_calls(calls: Connection, engine, send) -> None:
    """The child's calls thread: answers each ``Call`` on ``calls`` at once (``answer_now``),
    with a ``("reply", (call id, answer))`` through ``send``; ends when the socket closes. A
    call ``answer_now`` does not take is answered with a ``ValueError``."""
    try:
        while True:
            call = calls.recv()
            start_s = time.perf_counter()
            answered = answer_now(engine, call)
            if answered is None:
                answered = (ValueError(f"{call.method} cannot be answered while the engine steps"),)
            send(("reply", (call.call_id, answered[0])))
            log.debug("call %s answered in %.3f s", call.method, time.perf_counter() - start_s)
    except (EOFError, OSError):
        return  # the parent went away; the loop sees it on its own socket


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=os.environ.get("PREFIXSERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s",
    )
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    conn, calls = Connection(int(argv[0])), Connection(int(argv[1]))
    try:
        return serve_engine(conn, calls)
    finally:
        conn.close()
        calls.close()


if __name__ == "__main__":
    # Through the module's real name, so what the child pickles is worker.engine_process's
    # classes, not copies living in __main__ that the parent cannot unpickle.
    from worker.engine_process import main as module_main

    sys.exit(module_main(sys.argv[1:]))
