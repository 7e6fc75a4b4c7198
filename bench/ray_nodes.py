"""Several Ray nodes on one machine, each a ``ray start --block`` in a session of its own: start
one, find its processes, kill it, and ask Serve where its replicas run.

Each node has its own raylet, object store, agents, temp dir and worker ports (every port free
and derived, so it never meets another Ray on the machine); a second node joins the head's GCS
with ``--address``. Both register the machine's own address (Ray turns a loopback
``--node-ip-address`` into it anyway): several raylets share a host when their ports differ,
and a driver on that host connects to the head's. Used by ``tests/e2e/test_two_nodes.py`` and
``bench/scale_failover.py`` to lose a node the way a machine is lost: SIGKILL of every process
of its session (raylet, agents, workers and their engine processes).

How it fails: ``wait_for_port`` raises ``RuntimeError`` with the node's log tail when the node
exits or does not listen in time. ``stop_node`` never runs ``ray stop``, which would kill every
Ray instance of the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.common import free_ports

WORKER_PORTS_PER_NODE = 64
"""Worker ports per node (every actor and driver takes one)."""
SHUTDOWN_TIMEOUT_S = 30.0
HEALTH_CHECK_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "5",
}
"""The GCS notices a dead raylet after about period x threshold (defaults 3 s x 5); this
notices one in ~5 s, still after 5 missed probes, so a raylet starved of CPU for a few seconds
on a busy machine is not declared dead by mistake. For the head node's environment."""


def ray_cli() -> list[str]:
    script = shutil.which("ray")
    return [script] if script is not None else [sys.executable, "-m", "ray.scripts.scripts"]


@dataclass
class RayNode:
    """One ``ray start --block`` (its own session: the node's processes die with it)."""

    name: str
    process: subprocess.Popen
    log_path: Path
    temp_dir: str

    def processes(self) -> list[psutil.Process]:
        """Every process of the node: its session (``ray start`` opened one; the raylet, the
        agents, the workers, each in a process group of its own, and their engine processes
        stay in it) and any descendant of ``ray start`` that left it."""
        found = {}
        for process in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if os.getsid(process.pid) == self.process.pid:
                    found[process.pid] = process
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.process.pid)
            found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        return list(found.values())

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def start_node(
    name: str,
    args: list[str],
    env: dict,
    workdir: Path,
    extra_env: dict | None = None,
    num_cpus: float = 1,
) -> RayNode:
    """``ray start --block`` with ``args`` (``--head ...`` or ``--address HEAD``), ``num_cpus``
    logical CPUs, no GPU and the custom resource ``node_<name>`` (1), so that a driver can find
    the node's id and pin actors to it."""
    temp_dir = tempfile.mkdtemp(prefix=f"/tmp/r2{name}")  # short: Ray's socket paths are capped
    node_manager, object_manager, metrics, agent, agent_grpc, env_agent, *workers = free_ports(
        6 + WORKER_PORTS_PER_NODE
    )
    log_path = workdir / f"node-{name}.log"
    command = [
        *ray_cli(), "start", "--block", *args, "--num-cpus", str(num_cpus), "--num-gpus", "0",
        "--resources", json.dumps({f"node_{name}": 1}), "--temp-dir", temp_dir,
        "--node-manager-port", str(node_manager), "--object-manager-port", str(object_manager),
        "--metrics-export-port", str(metrics), "--dashboard-agent-listen-port", str(agent),
        "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(env_agent),
        "--worker-port-list", ",".join(map(str, workers)),
    ]  # fmt: skip
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**env, **(extra_env or {})},
            start_new_session=True,
        )  # fmt: skip
    return RayNode(name, process, log_path, temp_dir)


def stop_node(node: RayNode) -> None:
    """SIGKILLs every process of the node: a throwaway cluster keeps nothing worth a graceful
    stop, and ``ray start --block`` takes tens of seconds to stop its node on SIGTERM."""
    kill_all(node.processes())
    with contextlib.suppress(subprocess.TimeoutExpired):
        node.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
    shutil.rmtree(node.temp_dir, ignore_errors=True)


def kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=SHUTDOWN_TIMEOUT_S)


def wait_for_port(port: int, node: RayNode, deadline: float) -> None:
    """Until something listens on ``port`` (the node's GCS); raises if the node exits first or
    ``deadline`` (``time.monotonic``) passes."""
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if node.process.poll() is not None:
            raise RuntimeError(f"node {node.name} failed:\n{node.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {node.name} did not come up:\n{node.log_tail()}")
        time.sleep(0.2)


def node_ids(names: list[str]) -> dict[str, str]:
    """{node name: Ray node id} of the live nodes started by ``start_node`` (connected
    driver)."""
    import ray

    return {
        name: next(
            n["NodeID"] for n in ray.nodes() if n["Alive"] and f"node_{name}" in n["Resources"]
        )
        for name in names
    }


def serve_details() -> dict:
    """Serve's instance details (proxies and replicas with their nodes), from the controller:
    what the dashboard's /api/serve/applications/ shows, without running the dashboard."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    return ray.get(controller.get_serve_instance_details.remote(), timeout=30)


def replicas_by_node(details: dict, app_name: str, deployment: str) -> dict[str, str]:
    """{replica id: node id} of a deployment's RUNNING replicas."""
    app = details.get("applications", {}).get(app_name, {})
    replicas = app.get("deployments", {}).get(deployment, {}).get("replicas", [])
    return {r["replica_id"]: r["node_id"] for r in replicas if r["state"] == "RUNNING"}


def ingress_log_lines(node: RayNode, text: str) -> list[str]:
    """Lines holding ``text`` in the logs of the node's ingress replicas."""
    logs = [
        log
        for log in Path(node.temp_dir).glob("session_*/logs/serve/replica_*Ingress*.log")
        if "session_latest" not in log.parts  # a link to the session: each log once
    ]
    return [line for log in logs for line in log.read_text(errors="replace").splitlines()
            if text in line]  # fmt: skip
