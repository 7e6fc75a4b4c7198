"""``prefixserve serve`` stopped by SIGTERM to its whole process group ends at once.

``timeout``, ``kill -- -PGID`` and systemd's default stop signal every process of the group,
so the Ray processes the command started (GCS, raylet, dashboard, monitors) get SIGTERM too:
the dashboard and log monitor exit and the GCS stops answering. Before the fix the command's
shutdown then waited a minute for the GCS and died with an error. Ctrl-C (SIGINT to the group)
and SIGTERM to the command alone drain as before: ``test_readme_serve`` covers the first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from bench.common import free_port
from cluster.cli import _running

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240.0
# The fix ends the command within a watch period of a Ray process exiting; the old path took
# over 60 s (the GCS reconnect timeout).
EXIT_TIMEOUT_S = 20.0


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Ray's GCS, raylet, its workers, their engine processes)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = {int(c) for c in f.read().split()}
            except OSError:
                continue
            todo.extend(children - found)
            found |= children
    return found


def test_sigterm_to_the_process_group_ends_serve_at_once(tmp_path):
    from worker.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny-llama", "llama")
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFIXSERVE_API_KEY")}
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model)]
    argv += ["--num-replicas", "1", "--num-threads", "1", "--num-kv-blocks", "64"]
    argv += ["--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (_healthy(url) and f"{url}/v1" in log_path.read_text()):
            assert proc.poll() is None, f"serve exited early:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready:\n{log_path.read_text()[-4000:]}"
            time.sleep(1.0)
        tree = _descendants(proc.pid)
        assert any("engine_process" in _cmdline(pid) for pid in tree), tree

        sent_s = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0, log_path.read_text()[-4000:]
        took_s = time.monotonic() - sent_s
        assert "ended with the signal" in log_path.read_text(), log_path.read_text()[-4000:]

        deadline = time.monotonic() + 30  # Ray's processes follow their parent
        while any(map(_running, tree)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {pid: _cmdline(pid) for pid in tree if _running(pid)}
        assert not left, f"left running {took_s:.1f} s after the signal: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
