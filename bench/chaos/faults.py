"""The chaos benchmark's faults: which processes are SIGKILLed, and the Redis it slows or restarts.

Kill faults find a Ray worker by its process title (``ray::EngineReplica`` ...) among the
descendants of a root pid only, so another cluster on the same machine is never touched.
``SlowProxy`` is a TCP proxy in its own thread that adds ``REDIS_SLOW_DELAY_S`` to every chunk
when slowed; ``start_redis`` starts a throwaway ``redis-server`` (no persistence).

How it fails: a process that cannot be found is reported as not found (``None``), never as a
kill, so the fault is marked skipped rather than passed; ``start_redis`` raises
``RuntimeError`` when the server does not accept connections within 10 s; the proxy closes a
client's connection when Redis cannot be reached.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port

REDIS_SLOW_DELAY_S = 0.05
"""Latency the slow-Redis proxy adds to each chunk, each way."""
KILL_TITLES = {
    "replica_kill": "EngineReplica",
    "index_kill": "IndexActor",
    "ingress_kill": "Ingress",
    "tp_worker_kill": "TensorParallelWorker",
}
"""Faults that SIGKILL one Ray worker process, by the title (``ray::...``) it runs under."""
FAULTS = (*KILL_TITLES, "disconnect_storm", "slow_readers")
REDIS_FAULTS = ("redis_restart", "redis_slow")
TP_FAULTS = ("tp_worker_kill",)
"""Faults that need a server whose replicas run tensor-parallel workers."""


def processes_titled(root_pid: int, title: str) -> list:
    """The Ray worker processes under ``root_pid`` whose title (``ray::...``) names ``title``."""
    import psutil

    try:
        tree = psutil.Process(root_pid).children(recursive=True)
    except (psutil.NoSuchProcess, ValueError, TypeError):
        return []
    found = []
    for p in tree:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if cmd.startswith("ray::") and title in cmd:
            found.append(p)
    return found


def sigkill_one(root_pid: int, title: str) -> int | None:
    procs = processes_titled(root_pid, title)
    if not procs:
        return None
    os.kill(procs[0].pid, signal.SIGKILL)
    return procs[0].pid


class SlowProxy:
    """A TCP proxy in a thread that delays every chunk by ``delay_s`` (a slow Redis)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.port, self.target_port, self.delay_s = free_port(), target_port, 0.0
        self._delay_when_slow = delay_s
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)

    def slow(self, on: bool) -> None:
        self.delay_s = self._delay_when_slow if on else 0.0

    async def _serve(self) -> None:
        async def pipe(reader, writer) -> None:
            try:
                while data := await reader.read(65536):
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        async def handle(reader, writer) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        self._server = await asyncio.start_server(handle, "127.0.0.1", self.port)


def start_redis(port: int, workdir: Path) -> subprocess.Popen:
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(workdir)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


@dataclass
class RedisSide:
    """The redis-server behind the index (replaced when a fault restarts it) and its proxy."""

    proc: subprocess.Popen
    proxy: SlowProxy
    workdir: Path
