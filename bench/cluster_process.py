"""A benchmark's cluster process: a free port, waiting until every engine replica serves, and
stopping it (``bench/serve_compare.py`` launches one per (size, policy)).

How it fails: ``wait_healthy`` raises ``RuntimeError`` when the process exits first or the
cluster is not serving with every replica within the timeout; ``stop_server`` sends SIGINT,
then SIGTERM after ``STOP_GRACE_S``.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

import httpx

STOP_GRACE_S = 30.0  # Serve and Ray need a few seconds to drain and shut down cleanly


ROUTERS_SETTLE_S = 3.0
"""After the last engine replica reports, the ingress replicas' Serve handles learn it is
running by long poll (the controller marks it running after its first health check)."""


def serving_replicas(metrics_text: str) -> int:
    """Engine replicas a cluster's ``/metrics`` shows (its ``replica`` label values)."""
    return len(set(re.findall(r'\breplica="([^"]+)"', metrics_text)))


def wait_healthy(
    base_url: str, proc: subprocess.Popen, timeout_s: float, num_replicas: int
) -> None:
    """Until ``/health`` answers and ``/metrics`` shows every engine replica, then
    ``ROUTERS_SETTLE_S`` (a server without ``/metrics`` is ready at ``/health``). ``/health``
    alone passes with one replica up: a run started then measured a one-replica cluster for
    its first seconds (2026-11-26, the second replica ran 9 s later and the first 8 requests
    all went to the first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it was healthy")
        try:
            if httpx.get(base_url + "/health", timeout=5.0).status_code == 200:
                metrics = httpx.get(base_url + "/metrics", timeout=5.0)
                if metrics.status_code == 404:  # not a prefixserve cluster: /health it is
                    return
                if serving_replicas(metrics.text) >= num_replicas:
                    time.sleep(ROUTERS_SETTLE_S)
                    return
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    raise RuntimeError(f"server not healthy with {num_replicas} replicas within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(timeout=STOP_GRACE_S)
