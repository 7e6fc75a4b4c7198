"""Starting ranks 1..N-1 of one replica, their loop, their liveness and their end.

Rank 0 (``TensorParallelGroup.start``, called by the engine) hosts a ``TCPStore`` on a port
the OS picks on ``launcher.host()``, asks a ``WorkerLauncher`` to start one worker per other
rank with that address, waits until each has announced itself in the store (polling the
launcher, so a worker that dies while starting is an error at once, not a timeout), and
then joins the process groups. Each worker joins the groups *before* loading its shard, so
the wait covers only process start-up; a failure while loading closes its connection and
rank 0's first collective raises.

Launchers: ``LocalProcessLauncher`` here, for ``LLM(..., tensor_parallel_size=N)`` and tests,
and ``cluster.tp_workers.RayWorkerLauncher`` (actors in the replica's placement group) under
Ray Serve. Both say which ranks have ended (``dead_ranks``), which the engine's liveness
check reads, so a worker that dies while the replica is idle is noticed too.

``LocalProcessLauncher`` runs each rank as ``python -m worker.parallel.local_worker`` in a
fresh interpreter (``subprocess``, never ``multiprocessing``): the caller's ``__main__`` is
never re-imported, so a plain script without an ``if __name__ == "__main__":`` guard works,
on CPU and CUDA alike (nothing is forked). The child gets the parent's ``sys.path`` as
``PYTHONPATH`` (it imports the same code, from a checkout too) and the pickled
``(WorkerSpec, rank)`` on stdin. The pipe then stays open as a lifeline: when it closes (the
parent ended, however it ended) the worker exits at once, even while loading, so a worker
never outlives its parent. ``stop`` waits for the workers to return, then kills what is left.

Worker loop (``run_worker``): receive a step, run it, repeat, until rank 0 says stop or its
connection closes (rank 0 is gone: one INFO line, no traceback). CPU workers run
``threads_per_rank`` intra-op threads (the configured threads split between ranks), so N ranks
do not oversubscribe the cores.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from worker.config import EngineConfig
from worker.engine_process import child_env
from worker.parallel.communicator import ProcessGroupCommunicator

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 300.0
"""Start-up of N-1 workers (process start or Ray actor placement, imports) on a busy node."""
READY_POLL_S = 0.05
STOP_JOIN_S = 10.0
"""How long ``stop`` waits for a worker to return after the stop message before killing it."""
KILL_WAIT_S = 1.0
"""How long ``stop`` waits for a killed worker process to be reaped."""
LOCAL_WORKER_MODULE = "worker.parallel.local_worker"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard and join its replica's groups."""

    config: EngineConfig
    model_path: str
    """The resolved model folder (``worker.loader.resolve_model``), so no worker converts."""
    max_model_len: int
    host: str
    port: int
    """Rank 0's store: derived per replica (the OS picks the port)."""
    replica_id: str

    @property
    def world_size(self) -> int:
        return self.config.tensor_parallel_size


class WorkerLauncher(Protocol):
    def host(self) -> str:
        """The address rank 0's store listens on, reachable from every worker."""

    def start(self, spec: WorkerSpec) -> None:
        """Starts ranks 1..world_size-1, each calling ``run_worker(spec, rank)``."""

    def dead_ranks(self) -> list[int]:
        """Ranks whose worker has ended (crashed, killed, or returned)."""

    def stop(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for the workers to return, then kills what is left."""


def threads_per_rank(config: EngineConfig) -> int:
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // config.tensor_parallel_size)


def device_of_rank(config: EngineConfig, rank: int, local: bool) -> str:
    """Rank r's device: ``cuda:r`` for local processes on one machine; under Ray each worker
    sees only its bundle's GPU, which is ``cuda:0``."""
    if config.device.startswith("cuda") and local:
        return f"cuda:{rank}"
    return config.device


def check_local_gpus(tensor_parallel_size: int, visible_gpus: int) -> None:
    """Local ranks take ``cuda:0 .. cuda:N-1``: a ValueError before any worker starts when
    fewer GPUs are visible (a worker would otherwise die on an invalid device ordinal)."""
    if visible_gpus < tensor_parallel_size:
        raise ValueError(
            f"EngineConfig.tensor_parallel_size: {tensor_parallel_size} local ranks on CUDA need "
            f"{tensor_parallel_size} visible GPUs (rank r runs on cuda:r), this process sees "
            f"{visible_gpus}; lower tensor_parallel_size, set device='cpu', or run the replica "
            "under Ray with one GPU per rank"
        )


def _ready_key(rank: int) -> str:
    return f"ready/{rank}"


def make_communicator(
    spec: WorkerSpec, rank: int, store: dist.Store, device: str
) -> ProcessGroupCommunicator:
    return ProcessGroupCommunicator(
        store, rank, spec.world_size, torch.device(device), spec.config.deterministic
    )


def run_worker(spec: WorkerSpec, rank: int, local: bool = True) -> None:
    """A worker's whole life: join the groups, load the shard, run steps until told to stop."""
    from worker.cpu_runtime import configure_cpu_allocator
    from worker.model_runner import ModelRunner
    from worker.parallel.sharding import load_shard

    config = (
        spec.config.resolved()
    )  # a no-op when rank 0 resolved it; "auto" otherwise, decided here
    device = device_of_rank(config, rank, local)
    if device == "cpu":
        configure_cpu_allocator()
        torch.set_num_threads(threads_per_rank(config))
    else:
        torch.cuda.set_device(torch.device(device))
    store = dist.TCPStore(
        spec.host,
        spec.port,
        spec.world_size,
        False,
        datetime.timedelta(seconds=WORKER_START_TIMEOUT_S),
    )
    store.set(_ready_key(rank), "1")
    comm = make_communicator(spec, rank, store, device)
    model_spec, plan, weights = load_shard(
        spec.model_path, config.torch_dtype, rank, spec.world_size
    )
    runner = ModelRunner(
        config.replace(device=device),
        plan.local_spec(model_spec),
        weights,
        spec.max_model_len,
        comm,
        plan.vocab_start,
        full_spec=model_spec,
        shard=plan,
    )
    log.info(
        "TP worker %d/%d of %s ready (%d KV blocks)",
        rank,
        spec.world_size,
        spec.replica_id,
        runner.num_blocks,
    )
    while True:
        try:
            message = comm.recv_step()
        except RuntimeError as exc:  # gloo: rank 0's connection closed, i.e. rank 0 is gone
            reason = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())  # gloo's "[file:line] "
            log.info(
                "TP worker %d of %s: rank 0 is gone (%s); ending",
                rank,
                spec.replica_id,
                reason.split(". ", 1)[0][:200],
            )
            return
        if message is None:
            log.info("TP worker %d of %s: stopped by rank 0", rank, spec.replica_id)
            return
        runner.execute_message(message)


class LocalProcessLauncher:
    """Workers as fresh Python processes on this machine, each tied to this one by its stdin
    (``worker/parallel/local_worker.py``): they end when this process does."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen] = {}

    def host(self) -> str:
        return "127.0.0.1"

    def start(self, spec: WorkerSpec) -> None:
        from worker.parallel.local_worker import encode_frame

        if spec.config.device.startswith("cuda"):  # rank r takes cuda:r (device_of_rank)
            check_local_gpus(spec.world_size, torch.cuda.device_count())
        env = child_env()
        for rank in range(1, spec.world_size):
            label = f"tp-{spec.replica_id}-rank{rank}"  # shows in ps; the worker ignores it
            proc = subprocess.Popen(
                [sys.executable, "-m", LOCAL_WORKER_MODULE, label], stdin=subprocess.PIPE, env=env
            )
            self._procs[rank] = proc
            with contextlib.suppress(BrokenPipeError):  # it died at once; dead_ranks says so
                proc.stdin.write(encode_frame(spec, rank))
                proc.stdin.flush()

    def dead_ranks(self) -> list[int]:
        return [rank for rank, proc in self._procs.items() if proc.poll() is not None]

    def kill(self, rank: int) -> None:
        """Kills one worker (SIGKILL): what tests use to simulate a crash."""
        self._procs[rank].kill()

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    log.warning("TP worker pid %d did not end after SIGKILL", proc.pid)
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()  # the lifeline: a worker still alive here ends on its own


class TensorParallelGroup:
    """Rank 0's view of its replica's ranks: the communicator, the launcher, shutdown."""

    def __init__(self, comm: ProcessGroupCommunicator, launcher: WorkerLauncher, store: dist.Store):
        self.comm = comm
        self.launcher = launcher
        self._store = store  # rank 0 hosts it; workers' groups need it alive
        self._stopped = False

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        model_path: str,
        max_model_len: int,
        launcher: WorkerLauncher,
        replica_id: str,
    ) -> TensorParallelGroup:
        host = launcher.host()
        store = dist.TCPStore(
            host,
            0,
            config.tensor_parallel_size,
            True,
            datetime.timedelta(seconds=WORKER_START_TIMEOUT_S),
            wait_for_workers=False,
        )
        spec = WorkerSpec(config, model_path, max_model_len, host, store.port, replica_id)
        launcher.start(spec)
        group = None
        try:
            cls._wait_ready(store, launcher, config.tensor_parallel_size)
            comm = make_communicator(spec, 0, store, config.device)
            group = cls(comm, launcher, store)
            log.info(
                "tensor parallel group of %s: %d ranks at %s:%d",
                replica_id,
                spec.world_size,
                host,
                store.port,
            )
            return group
        finally:
            if group is None:
                launcher.stop(0.0)

    @staticmethod
    def _wait_ready(store: dist.Store, launcher: WorkerLauncher, world_size: int) -> None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        keys = [_ready_key(rank) for rank in range(1, world_size)]
        while not store.check(keys):
            dead = launcher.dead_ranks()
            if dead:
                raise RuntimeError(
                    f"tensor-parallel worker rank(s) {dead} ended while starting; see their logs"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel workers did not start within {WORKER_START_TIMEOUT_S:.0f}s"
                )
            time.sleep(READY_POLL_S)

    def dead_ranks(self) -> list[int]:
        return self.launcher.dead_ranks()

    def stop(self) -> None:
        """Tells the workers to return (if they still listen), then ends them. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if not self.launcher.dead_ranks():
                self.comm.send_stop()
        except RuntimeError as exc:  # a peer already gone: the launcher ends the rest
            log.warning("stop message not delivered: %s", exc)
        self.launcher.stop(STOP_JOIN_S)
