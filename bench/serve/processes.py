"""Child processes: a server in its own session, its log file, its CPU time, and stopping it.

Owns ``Server`` (start, wait for ``/health``, CPU seconds of the process tree, stop),
``server_env`` (thread counts and ``PYTHONPATH`` for a child) and the repository
root every child runs in.

Failure modes: ``Server.wait_ready`` raises ``RuntimeError`` when the process exits first or
does not answer within the timeout (the caller stops it). ``Server.stop`` never raises for a
process that is already gone: SIGINT, ``STOP_GRACE_S`` to drain, then SIGTERM and SIGKILL to
the process group and to every descendant it has seen (by pid), ``KILL_GRACE_S`` each. Tests
shorten the graces by patching them here, in ``bench.serve.processes``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 30.0  # Serve and Ray drain and shut down in a few seconds
KILL_GRACE_S = 10.0


class Server:
    """One subprocess in its own session (process group), its log in a file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None):
        self.name, self.argv, self.log_path = name, argv, log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=REPO,
        )
        self._known: dict[int, object] = {}

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def _tree(self) -> list:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            self._known.setdefault(p.pid, p)
        return procs

    def cpu_seconds(self) -> float:
        """User + system CPU of the live process tree, plus what its reaped children used."""
        import psutil

        total = 0.0
        for p in self._tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
        return total

    def cpu_by_process(self) -> dict[str, float]:
        """CPU seconds (user + system) of each live process of the tree, keyed by what the
        process is: its name in Ray's process title (``ray::ProxyActor``, ``ray::ServeReplica
        :app:EngineReplica``), else its command's program and module (``python -m
        worker.engine_process``); processes of one kind add up. The difference of two snapshots
        (``http_load.cpu_breakdown``) says which process of a served run used the cores."""
        import psutil

        totals: dict[str, float] = {}
        for p in self._tree():
            try:
                t = p.cpu_times()
                label = process_label(p.cmdline(), p.name())
            except psutil.Error:
                continue
            totals[label] = totals.get(label, 0.0) + t.user + t.system
        return totals

    def wait_ready(self, url: str, timeout_s: float, ready=None) -> float:
        """Polls ``url`` until 200 (and ``ready()`` is true); returns the seconds it took."""
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode} before it was ready "
                    f"(log: {self.log_path})"
                )
            try:
                if httpx.get(url, timeout=5.0).status_code == 200 and (ready is None or ready()):
                    self._tree()
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready within {timeout_s:.0f} s (log: {self.log_path})")

    def stop(self) -> None:
        import psutil

        self._tree()
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=STOP_GRACE_S)
            for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, sig)  # the session's group: the server and its helpers
                alive = [p for p in self._known.values() if _alive(p)]
                for p in alive:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(sig)  # descendants that left the group (by pid, ours only)
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline:
                    alive = [p for p in alive if _alive(p)]  # zombies count as gone
                    if self.proc.poll() is not None and not alive:
                        break
                    time.sleep(0.1)
                if self.proc.poll() is not None and not alive:
                    break
        finally:
            self._log.close()


def process_label(cmdline: list[str], name: str) -> str:
    """A short, stable name for a process: Ray workers name their actor in ``argv[0]``, with the
    method running now appended (``ray::ServeController.listen_for_change`` -> ``ray::
    ServeController``), Python processes by their module or script, other programs by name."""
    if not cmdline:
        return name
    first = cmdline[0]
    if first.startswith("ray::"):
        return first.split()[0].split(".")[0]
    program = Path(first).name
    if program.startswith("python"):
        rest = cmdline[1:]
        if len(rest) >= 2 and rest[0] == "-m":
            return f"python -m {rest[1]}"
        return f"python {Path(rest[0]).name}" if rest else program
    return program


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != "zombie"
    except Exception:
        return False


def server_env(threads: int) -> dict:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env
