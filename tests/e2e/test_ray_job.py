"""Deploy and batch as Ray jobs, the way users run prefixserve on an existing Ray cluster.

Starts ``ray start --head --block`` on loopback (every port free and derived, its own temp
dir, so it never meets another Ray on the machine) and on that one cluster:

1. the detached form, ``ray job submit --working-dir <repo> -- prefixserve serve --address
   auto --detach --host 0.0.0.0 ...``: the job deploys, waits until a completion goes
   through, prints the URL and succeeds; the app answers right away, on loopback and on the
   machine's own address (``--host 0.0.0.0``), after the job has ended;
2. ``prefixserve batch`` as a second job against it;
3. the blocking form (no ``--detach``, no ``--host``: it warns that loopback is unreachable
   from other machines) replaces the app and serves until ``ray job stop``, which drains and
   deletes it (the head runs with ``RAY_JOB_STOP_WAIT_TIME_S`` above Ray's 3 s);
4. the Helm chart's rendered serveConfigV2 (deployment options, placement-group bundles,
   args) through ``serve deploy``, and a chat again.

Finally it SIGTERMs the head it started (which takes down every process of that node). Never
``ray stop``: that would kill other Ray instances on a shared machine. The chart step is
skipped only without helm.
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

from bench.common import free_ports

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
# Head start, job runtime-env setup, tiny-model load and Serve health checks on a busy box.
STARTUP_TIMEOUT_S = 300.0
JOB_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 60.0
# Never upload these with the working dir: helm binaries, caches, results.
UPLOAD_EXCLUDES = [".tools", ".git", "bench/results", "**/__pycache__", "*.egg-info"]
NUM_BATCH_REQUESTS = 5
# `ray job stop` SIGTERMs the driver and SIGKILLs it after this long (Ray's default is 3 s):
# room for the blocking form to drain and delete its app.
JOB_STOP_WAIT_S = 60
# The dashboard answers before its job agent is ready; a first submit can fail on a busy box.
SUBMIT_ATTEMPTS = 3
SUBMIT_RETRY_S = 5.0
JOB_ENDED = ("SUCCEEDED", "FAILED", "STOPPED")


def prefixserve_command() -> str:
    script = shutil.which("prefixserve")
    return script if script is not None else f"{sys.executable} -m cluster.cli"


def ray_cli() -> list[str]:
    script = shutil.which("ray")
    return [script] if script is not None else [sys.executable, "-m", "ray.scripts.scripts"]


def own_address() -> str | None:
    """This machine's address on its network (not loopback); None without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
        except OSError:
            return None
        address = sock.getsockname()[0]
    return None if address.startswith("127.") else address


def job_status(address: str, job_id: str) -> str:
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(address).get_job_status(job_id).value)


def submit_job(submit: list[str], env: dict, command: list[str], prefix: str = "job") -> str:
    """Submits ``command`` as a job without tailing its logs (``ray job submit``'s log tail is
    a WebSocket that a busy dashboard can drop mid-job); returns its id. A submit refused
    before the job is created (the job agent not ready yet) is retried."""
    for attempt in range(SUBMIT_ATTEMPTS):
        job_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
        submitted = subprocess.run(
            [*submit, "--submission-id", job_id, "--no-wait", "--", *command],
            env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
        )  # fmt: skip
        if submitted.returncode == 0 or attempt == SUBMIT_ATTEMPTS - 1:
            break
        time.sleep(SUBMIT_RETRY_S)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    return job_id


def run_job(submit: list[str], env: dict, address: str, command: list[str]) -> tuple[str, str]:
    """``submit_job``, then waits until the job ends; returns its final status and its logs."""
    from ray.job_submission import JobSubmissionClient

    job_id = submit_job(submit, env, command)
    client = JobSubmissionClient(address)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (status := str(client.get_job_status(job_id).value)) not in JOB_ENDED:
        assert time.monotonic() < deadline, f"job {job_id} still {status}"
        time.sleep(1.0)
    return status, client.get_job_logs(job_id)


def chat(url: str) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hello there"}],
              "max_tokens": 8, "temperature": 0},
        timeout=120,
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] >= 1
    return body


def run_batch_job(submit: list[str], env: dict, address: str, url: str, tmp_path: Path) -> None:
    batch_in, batch_out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch_in.write_text(
        "".join(
            json.dumps({"id": f"b{i}", "prompt": f"Item {i}:", "max_tokens": 4}) + "\n"
            for i in range(NUM_BATCH_REQUESTS)
        )
    )
    status, logs = run_job(
        submit, env, address,
        [*prefixserve_command().split(), "batch", "--input", str(batch_in),
         "--output", str(batch_out), "--url", url, "--no-progress"],
    )  # fmt: skip
    assert status == "SUCCEEDED", logs[-3000:]
    answers = [json.loads(line) for line in batch_out.read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == [f"b{i}" for i in range(NUM_BATCH_REQUESTS)]
    assert all(a["response"]["status_code"] == 200 for a in answers)


def chart_serve_config(model: str, cache_dir: Path, http_port: int) -> dict | None:
    """The Helm chart's serveConfigV2 for a one-replica CPU deployment; None without helm."""
    from tests.deploy import chart

    if chart.install_helm()[0] is None:
        return None
    values = {
        "serve": {"appName": "chart"},
        "engine": {"model": model, "device": "cpu", "dtype": "float32",
                   "kvCacheMemoryFraction": None, "numKvBlocks": 256, "maxModelLen": 512},
        "cluster": {"numReplicas": 1, "numCpusPerReplica": 1},
        "gpuWorkers": {"enabled": False},
        "cpuWorkers": {"enabled": True, "cpus": 1},
        "redis": {"enabled": False},
        "modelCache": {"mountPath": str(cache_dir)},
    }  # fmt: skip
    config = chart.serve_config(chart.render(values=values))
    # Kubernetes exposes 0.0.0.0:8000 through a Service; here Serve already listens on loopback.
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    return config


def test_serve_and_batch_as_ray_jobs(tmp_path):
    from worker.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", "llama")
    gcs, dashboard, client, agent, agent_grpc, metrics, env_agent, http = free_ports(8)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFIXSERVE_API_KEY")}
    # Loopback-only test cluster: no token auth (Ray >= 2.5x enables it by default), no
    # telemetry; the repo on PYTHONPATH so `serve deploy` finds cluster.app uninstalled too.
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               RAY_JOB_STOP_WAIT_TIME_S=str(JOB_STOP_WAIT_S))  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rj")  # short: Ray's socket paths have a length cap
    head_log = tmp_path / "head.log"
    with head_log.open("w") as log:
        head = subprocess.Popen(
            [*ray_cli(), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--port", str(gcs), "--dashboard-host", "127.0.0.1",
             "--dashboard-port", str(dashboard),
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

        serve_args = ["--port", str(http), "--model", model, "--num-replicas", "1",
                      "--num-kv-blocks", "256", "--max-model-len", "512"]  # fmt: skip

        # 1. The detached form: the job deploys, proves the app routes, prints the URL, ends.
        status, logs = run_job(
            submit, job_env, address,
            [*prefixserve_command().split(), "serve", "--address", "auto", "--detach",
             "--host", "0.0.0.0", *serve_args],
        )  # fmt: skip
        assert status == "SUCCEEDED", logs[-3000:]
        assert "(detached:" in logs and f":{http}/v1" in logs, logs[-3000:]
        chat(url)  # no wait: the job ended only once a completion went through
        public = own_address()
        if public is not None:  # --host 0.0.0.0: reachable on the machine's own address too
            assert httpx.get(f"http://{public}:{http}/v1/models", timeout=30).status_code == 200

        # 2. A batch as a Ray job against the detached app.
        run_batch_job(submit, job_env, address, url, tmp_path)

        # 3. The blocking form replaces the app, serves until stopped, then deletes it.
        serve_job = submit_job(
            submit, job_env,
            [*prefixserve_command().split(), "serve", "--address", "auto",
             "--served-model-name", "blocking", *serve_args],
            prefix="serve",
        )  # fmt: skip
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:  # the detached app keeps answering until the blocking one replaces it
            with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
                models = httpx.get(f"{url}/v1/models", timeout=5).json()
                if models["data"][0]["id"] == "blocking":
                    break
            assert head.poll() is None, f"ray head died:\n{head_log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"the blocking job's app never served: {job_status(address, serve_job)}"
            )
            time.sleep(1.0)
        assert chat(url)["model"] == "blocking"
        assert job_status(address, serve_job) == "RUNNING"
        logs = subprocess.run([*ray_cli(), "job", "logs", serve_job], env=job_env,
                              capture_output=True, text=True,
                              timeout=SHUTDOWN_TIMEOUT_S).stdout  # fmt: skip
        assert "pass --host 0.0.0.0" in logs, logs[-3000:]  # joined a cluster on loopback only
        subprocess.run([*ray_cli(), "job", "stop", serve_job], env=job_env, capture_output=True,
                       timeout=JOB_STOP_WAIT_S + SHUTDOWN_TIMEOUT_S, check=True)  # fmt: skip
        assert job_status(address, serve_job) == "STOPPED"
        applications = httpx.get(f"{address}/api/serve/applications/", timeout=10).json()
        assert applications["applications"] == {}, applications  # drained and deleted

        # 4. The Helm chart's serveConfigV2 (deployment options, bundles, args) through
        #    `serve deploy`, on the same Serve instance.
        config = chart_serve_config(model, tmp_path / "cache", http)
        if config is not None:
            config_path = tmp_path / "chart-serve-config.yaml"
            config_path.write_text(json.dumps(config))
            serve = shutil.which("serve") or "serve"
            deployed = subprocess.run(
                [serve, "deploy", str(config_path), "--address", address],
                env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
            )  # fmt: skip
            assert deployed.returncode == 0, deployed.stderr[-3000:]
            deadline, status = time.monotonic() + STARTUP_TIMEOUT_S, {}
            while True:  # the chart's app comes up
                with contextlib.suppress(httpx.HTTPError, KeyError, IndexError):
                    status = httpx.get(f"{address}/api/serve/applications/", timeout=10).json()
                    if list(status["applications"]) == ["chart"] and (
                        status["applications"]["chart"]["status"] == "RUNNING"
                    ):
                        break
                assert time.monotonic() < deadline, f"chart config not running: {status}"
                time.sleep(1.0)
            chat(url)
            deployment = status["applications"]["chart"]["deployments"]["EngineReplica"]
            assert [r["state"] for r in deployment["replicas"]] == ["RUNNING"]
            # The chart's per-replica bundles took effect: Serve made the replica a placement
            # group (it makes none without placement_group_bundles).
            from ray.util.state import list_placement_groups

            groups = list_placement_groups(address=address, detail=True)
            created = [
                [b["unit_resources"] for b in g.bundles] for g in groups if g.state == "CREATED"
            ]
            assert created == [[{"CPU": 1.0}]], groups
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
