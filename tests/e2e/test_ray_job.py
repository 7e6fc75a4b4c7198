"""Deploy and batch as Ray jobs, the way users run prefixserve on an existing Ray cluster.

Starts ``ray start --head --block`` on loopback (every port free and derived, its own temp
dir, so it never meets another Ray on the machine), submits
``ray job submit --working-dir <repo> -- prefixserve serve --address auto ...``, asks a chat
completion over HTTP, submits ``prefixserve batch`` as a second job, then stops the deploy
job and SIGTERMs the head it started (which takes down every process of that node). Never
``ray stop``: that would kill other Ray instances on a shared machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
# Head start, job runtime-env setup, tiny-model load and Serve health checks on a busy box.
STARTUP_TIMEOUT_S = 300.0
JOB_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 60.0
# Never upload these with the working dir: helm binaries, caches, results.
UPLOAD_EXCLUDES = [".tools", ".git", "bench/results", "**/__pycache__", "*.egg-info"]
NUM_BATCH_REQUESTS = 5


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def prefixserve_command() -> str:
    script = shutil.which("prefixserve")
    return script if script is not None else f"{sys.executable} -m cluster.cli"


def ray_cli() -> list[str]:
    script = shutil.which("ray")
    return [script] if script is not None else [sys.executable, "-m", "ray.scripts.scripts"]


def wait_healthy(url: str, head: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        assert head.poll() is None, f"ray head died:\n{log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        assert time.monotonic() < deadline, "the deployed app did not become healthy in time"
        time.sleep(1.0)


def test_serve_and_batch_as_ray_jobs(tmp_path):
    from worker.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", "llama")
    gcs, dashboard, client, agent, agent_grpc, metrics, env_agent, http = free_ports(8)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFIXSERVE_API_KEY")}
    # Loopback-only test cluster: no token auth (Ray >= 2.5x enables it by default), no telemetry.
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rj")  # short: Ray's socket paths have a length cap
    head_log = tmp_path / "head.log"
    with head_log.open("w") as log:
        head = subprocess.Popen(
            [*ray_cli(), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
             "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
             "--dashboard-agent-grpc-port", str(agent_grpc), "--metrics-export-port", str(metrics),
             "--runtime-env-agent-port", str(env_agent), "--num-cpus", "4", "--num-gpus", "0",
             "--temp-dir", temp_dir, "--include-dashboard", "true"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    address = f"http://127.0.0.1:{dashboard}"
    job_env = {**env, "RAY_ADDRESS": address}
    runtime_env = json.dumps({"excludes": UPLOAD_EXCLUDES})
    submit = [*ray_cli(), "job", "submit", "--working-dir", str(REPO_ROOT),
              "--runtime-env-json", runtime_env]  # fmt: skip
    serve_job = f"serve-{uuid.uuid4().hex[:8]}"
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:  # the job server answers once the dashboard is up
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{address}/api/version", timeout=5).status_code == 200:
                    break
            assert head.poll() is None, f"ray start failed:\n{head_log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "ray head did not come up"
            time.sleep(1.0)

        subprocess.run(
            [*submit, "--submission-id", serve_job, "--no-wait", "--",
             *prefixserve_command().split(), "serve", "--address", "auto", "--host", "127.0.0.1",
             "--port", str(http), "--model", model, "--num-replicas", "1", "--num-kv-blocks", "256",
             "--max-model-len", "512"],
            env=job_env, check=True, capture_output=True, timeout=JOB_TIMEOUT_S,
        )  # fmt: skip
        wait_healthy(url, head, head_log)

        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"],
                  "messages": [{"role": "user", "content": "Hello there"}],
                  "max_tokens": 8, "temperature": 0},
            timeout=120,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] >= 1

        batch_in, batch_out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        batch_in.write_text(
            "".join(
                json.dumps({"id": f"b{i}", "prompt": f"Item {i}:", "max_tokens": 4}) + "\n"
                for i in range(NUM_BATCH_REQUESTS)
            )
        )
        batch = subprocess.run(
            [*submit, "--", *prefixserve_command().split(), "batch", "--input", str(batch_in),
             "--output", str(batch_out), "--url", url, "--no-progress"],
            env=job_env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
        )  # fmt: skip
        assert batch.returncode == 0, batch.stdout[-3000:] + batch.stderr[-3000:]
        answers = [json.loads(line) for line in batch_out.read_text().splitlines()]
        assert sorted(a["custom_id"] for a in answers) == [
            f"b{i}" for i in range(NUM_BATCH_REQUESTS)
        ]
        assert all(a["response"]["status_code"] == 200 for a in answers)
    finally:
        subprocess.run(
            [*ray_cli(), "job", "stop", serve_job], env=job_env, capture_output=True,
            timeout=SHUTDOWN_TIMEOUT_S, check=False,
        )  # fmt: skip
        head.send_signal(signal.SIGTERM)  # the head kills every process it started
        try:
            head.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # our own session only
            head.wait(timeout=SHUTDOWN_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # stragglers of that session, if any
        shutil.rmtree(temp_dir, ignore_errors=True)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=5)
