"""What runs: the (system, concurrency) plan, and starting each system's server(s).

Owns ``Run`` and ``plan`` (one-replica systems per concurrency, then the clusters at
``--cluster-concurrency``), ``start_servers`` (``prefixserve serve``, ``llama-server``, or N
llama-servers behind ``sglang_router.launch_router``), the llama-server command line and the
GGUF both engines load.

Failure modes: ``start_servers`` appends each ``Server`` to the caller's list as soon as it
starts, so a failure half-way (a port race, a missing binary, a server that dies) still leaves
every started process in the list for the caller to stop; the readiness check it returns
raises ``RuntimeError`` from ``Server.wait_ready``. A cluster is ready only when ``/metrics``
reports all its replicas.
"""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port

from .processes import Server, server_env

SYSTEMS = ("offline", "served", "llama")


@dataclass
class Run:
    system: str
    label: str
    concurrency: int
    kind: str  # offline | prefixserve | llama | llama-router
    replicas: int = 1
    threads: int = 2


def plan(args) -> list[Run]:
    runs, t = [], args.threads
    for c in args.concurrency:
        if "offline" in args.systems:
            runs.append(Run("offline", f"offline LLM ({t} threads)", c, "offline", 1, t))
        if "served" in args.systems:
            runs.append(Run("served", f"prefixserve 1x{t}", c, "prefixserve", 1, t))
        if "llama" in args.systems:
            runs.append(Run("llama", f"llama-server 1x{t}", c, "llama", 1, t))
    n, cc = args.cluster_replicas, args.cluster_concurrency
    if n and n > 1:
        if "served" in args.systems:
            runs.append(
                Run(
                    "served-cluster", f"prefixserve {n}x1 (prefix routing)", cc, "prefixserve", n, 1
                )
            )
        if "llama" in args.systems:
            runs.append(
                Run(
                    "llama-cluster", f"llama-server {n}x1 + sglang-router", cc, "llama-router", n, 1
                )
            )
    return runs


def _llama_argv(binary: str, gguf: str, threads: int, slots: int, port: int) -> list[str]:
    return [
        binary,
        "-m",
        gguf,
        "-t",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * 1024),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def start_servers(
    run: Run, args, tag: str, servers: list[Server]
) -> tuple[str, Callable[[], None]]:
    """Starts the run's server(s) into ``servers`` (so a failure half-way still stops them);
    returns the base URL to load and a readiness check."""
    if run.kind == "prefixserve":
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "cluster.cli",
            "serve",
            "--num-replicas",
            str(run.replicas),
            "--num-threads",
            str(run.threads),
            "--num-kv-blocks",
            str(args.num_kv_blocks),
            "--port",
            str(port),
            "--expose-replica-headers",  # per-replica request counts
            *shlex.split(args.serve_args),
        ]
        servers.append(
            Server(run.label, argv, args.log_dir / f"serve_{tag}.log", server_env(run.threads))
        )
        base = f"http://127.0.0.1:{port}"
        replicas = run.replicas

        def ready() -> None:
            servers[0].wait_ready(
                base + "/health",
                args.startup_timeout_s,
                ready=(lambda: replicas_in_metrics(base) >= replicas) if replicas > 1 else None,
            )

        return base, ready
    gguf = str(_gguf_path())
    if run.kind == "llama":
        port = free_port()
        servers.append(
            Server(
                run.label,
                _llama_argv(args.llama_server, gguf, run.threads, run.concurrency, port),
                args.log_dir / f"serve_{tag}.log",
            )
        )
        base = f"http://127.0.0.1:{port}"
        return base, lambda: servers[0].wait_ready(base + "/health", args.startup_timeout_s)
    # llama-router: N llama-servers behind sglang-router
    slots = max(1, math.ceil(run.concurrency / run.replicas))
    worker_urls = []
    for i in range(run.replicas):
        port = free_port()
        worker_urls.append(f"http://127.0.0.1:{port}")
        servers.append(
            Server(
                f"llama-server {i}",
                _llama_argv(args.llama_server, gguf, run.threads, slots, port),
                args.log_dir / f"serve_{tag}_worker{i}.log",
            )
        )
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "cache_aware",
        "--worker-urls",
        *worker_urls,
    ]
    base = f"http://127.0.0.1:{port}"

    def ready() -> None:
        for s, url in zip(servers, worker_urls, strict=True):
            s.wait_ready(url + "/health", args.startup_timeout_s)
        servers.append(Server("sglang-router", argv, args.log_dir / f"serve_{tag}_router.log"))
        servers[-1].wait_ready(base + "/health", args.startup_timeout_s)

    return base, ready


def _gguf_path() -> Path:
    from worker.loader import _bundled_gguf

    return _bundled_gguf("smollm2")[0]


def replicas_in_metrics(base_url: str) -> int:
    """How many distinct engine replicas prefixserve's /metrics reports (each pushes its series
    once it serves; a killed one's go stale); 0 when the server does not answer."""
    import re

    import httpx

    try:
        text = httpx.get(base_url + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return 0
    return len(set(re.findall(r'replica="([^"]+)"', text)))


def has_sglang_router() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang_router") is not None
