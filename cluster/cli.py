"""The ``prefixserve`` command: ``serve`` here; other subcommands plug in via ``SUBCOMMAND_HOOKS``.

``prefixserve serve`` maps its flags onto ``EngineConfig``/``ClusterConfig``/``RouterConfig``
(vLLM's flag names where the meaning is the same; a flag left out keeps the dataclass
default), validates them before touching Ray (a bad flag exits with status 2 and the
message naming the field), starts a local Ray instance or joins ``--address``, runs the
application and blocks until SIGINT/SIGTERM. Then it drains (in-flight requests get
``DRAIN_TIMEOUT_S`` to finish; the rest end with finish_reason ``abort`` and ``[DONE]``),
deletes the application and, if it started Ray itself, shuts Serve and Ray down. A SIGTERM
sent to the whole process group (``timeout``, systemd's default stop) also stops the Ray it
started, leaving nothing to drain: the command then exits at once (``_exit_when_own_ray_ends``)
instead of waiting a minute for a GCS that stopped answering.

This module owns the entry point, the subcommand dispatch and that Ray lifecycle; the flag
table lives in ``cluster/cli_flags.py`` and the parsing of flags and ``--config`` files in
``cluster/cli_options.py``: import their names from there.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import signal
import sys
import threading
import time

from cluster.cli_options import add_serve_arguments, args_from_namespace
from cluster.config import API_KEY_ENV, configs_from_args
from cluster.priority import lower_ray_system_priority

# On Ctrl-C, in-flight requests get this long to finish before they are aborted.
DRAIN_TIMEOUT_S = 5.0
# A call to the metrics hub during shutdown; it answers in milliseconds unless wedged.
DRAIN_CALL_TIMEOUT_S = 5.0
# While shutting down: how often the command checks that the Ray it started is still there.
RAY_WATCH_PERIOD_S = 0.2
# --detach: model download and load on the cluster, then Serve's health checks; a one-token
# completion then proves the app routes (each probe waits this long for its answer).
DETACH_READY_TIMEOUT_S = 1800.0
READY_PROBE_TIMEOUT_S = 60.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DIRECT_INGRESS_WAIT_S = 60.0
"""How long ``--direct-ingress`` waits for every ingress replica's own port before printing."""
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"
RAY_SYSTEM_RENICE_DELAYS_S = (0.0, 2.0, 5.0, 10.0, 30.0)
"""Ray's setting for the niceness of the worker processes it starts (its default is 15)."""
# Other modules add subcommands by exposing ``add_parser(subparsers)`` that registers a
# parser whose defaults set ``handler`` (a function of the parsed namespace returning an exit
# code). A hook whose module is not there yet is skipped.
SUBCOMMAND_HOOKS = ("cluster.batch:add_parser", "bench.cli:add_parser")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="Serve an OpenAI-compatible API on a Ray Serve cluster.",
        description="Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, ...) "
        "on Ray Serve. With no flags: the bundled SmolLM2 model on 2 CPU replicas at "
        "http://127.0.0.1:8000.",
    )
    add_serve_arguments(parser)
    parser.set_defaults(handler=run_serve)
    return parser


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def _child_pids() -> set[int] | None:
    """This process's children, from Linux's /proc; None where that cannot be read."""
    try:
        children: set[int] = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(int(pid) for pid in f.read().split())
    except OSError:
        return None
    return children


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _exit_when_own_ray_ends(ray_children: set[int], stop_watching: threading.Event) -> None:
    """While this command shuts down the Ray it started (``ray_children``: the GCS, raylet,
    dashboard and monitors, this process's children), ends the command at once if one of
    them exits, until ``stop_watching`` is set.

    Ray's processes ignore SIGINT, so Ctrl-C in a terminal drains as usual. SIGTERM sent to
    the whole process group (``timeout``, ``kill -- -PGID``, systemd's default stop) also
    reaches them: the dashboard and log monitor exit and the GCS stops answering, and every
    Ray call after that waits a minute for the GCS before the process dies with an error.
    Nothing is left to drain then; the rest of Ray ends with this process (Ray ties its
    processes' lives to their parent's)."""

    def watch() -> None:
        while not stop_watching.wait(RAY_WATCH_PERIOD_S):
            if not all(_running(pid) for pid in ray_children):
                print(
                    "prefixserve: Ray's processes ended with the signal (it went to the whole "
                    "process group); in-flight requests were cut off. Signal this process "
                    "alone to drain them.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(0)

    threading.Thread(target=watch, name="watch-own-ray", daemon=True).start()


def _drain(app_name: str) -> None:
    """Lets in-flight requests finish for ``DRAIN_TIMEOUT_S``, then has the replicas abort
    the rest, so every open stream ends with a final chunk and ``[DONE]``."""
    import time

    from ray import serve

    from cluster.metrics import METRICS_PUSH_PERIOD_S, num_busy_requests
    from cluster.serve_compat import tell_replicas

    try:
        hub = serve.get_deployment_handle("MetricsHub", app_name)
        replica_ids = list(hub.snapshots.remote().result(timeout_s=DRAIN_CALL_TIMEOUT_S))
        tell_replicas(
            app_name,
            "EngineReplica",
            replica_ids,
            "begin_drain",
            DRAIN_TIMEOUT_S,
            timeout_s=DRAIN_CALL_TIMEOUT_S,
        )
        # Each replica reports idle on its next push once its requests are done.
        deadline_s = time.monotonic() + DRAIN_TIMEOUT_S + 2 * METRICS_PUSH_PERIOD_S
        time.sleep(METRICS_PUSH_PERIOD_S)
        while time.monotonic() < deadline_s:
            snapshots = hub.snapshots.remote().result(timeout_s=DRAIN_CALL_TIMEOUT_S)
            if num_busy_requests(snapshots) == 0:
                return
            time.sleep(METRICS_PUSH_PERIOD_S / 2)
    except Exception as exc:  # draining is a courtesy; shutdown goes on regardless
        print(f"prefixserve: drain skipped: {exc!r}", file=sys.stderr, flush=True)


def wait_until_routable(url: str, api_key: str | None, timeout_s: float) -> None:
    """Until a one-token completion comes back 200 (proxy, ingress, router and an engine
    replica all answered: ``/health`` can say 200 before the app routes); TimeoutError with
    the last answer otherwise."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline_s = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            reply = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": "Hello", "max_tokens": 1},
                headers=headers,
                timeout=READY_PROBE_TIMEOUT_S,
            )
            if reply.status_code == 200:
                return
            last = f"HTTP {reply.status_code}: {reply.text[:300]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"{url} did not serve a completion in {timeout_s:.0f} s ({last})")
        time.sleep(1.0)


def run_serve(ns: argparse.Namespace) -> int:
    try:
        engine, cluster, router = configs_from_args(args_from_namespace(ns))
        detach = bool(getattr(ns, "detach", False))
        if detach and cluster.ray_address is None:
            raise ValueError(
                "--detach needs --address (a running Ray cluster to leave the app on); "
                "without it prefixserve starts its own Ray, which ends with the command"
            )
    except ValueError as exc:
        print(f"prefixserve serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cluster.log_level.upper())
    import ray
    from ray import serve

    from cluster.app import (
        DIRECT_INGRESS_ENV,
        PROXY_GRPC_ENV,
        build_app_from_configs,
        serve_env,
    )

    started_ray = cluster.ray_address is None
    if started_ray:
        # Logical CPUs, not cores: the replicas' CPU reservations must fit even on a small
        # machine (the engines then share its cores).
        needed = (
            math.ceil(
                cluster.num_replicas * cluster.num_cpus_per_replica * engine.tensor_parallel_size
            )
            + 1
        )
        # Ray starts its workers at nice 15 by default, below any process of the user's (a
        # client, a peer server) that competes for the cores; the engine replicas are the work.
        os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")
        # Serve's proxy and controller read these from the cluster's environment (the
        # deployments get them through their runtime_env): cluster/app.py's SERVE_ENV.
        os.environ.update(serve_env())
        if cluster.direct_ingress:
            os.environ[DIRECT_INGRESS_ENV] = "1"  # the controller allocates the ports
        os.environ.setdefault(PROXY_GRPC_ENV, "1" if cluster.handle_transport == "grpc" else "0")
        # A local cluster stays on loopback: nothing it runs listens on another address.
        ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False,
                 _node_ip_address="127.0.0.1", logging_level=cluster.log_level.upper())  # fmt: skip
    else:
        ray.init(address=cluster.ray_address, logging_level=cluster.log_level.upper())
        if cluster.host in LOOPBACK_HOSTS:
            print(
                f"prefixserve: warning: HTTP on {cluster.host} only: nothing off the node running "
                "Serve's proxy can reach it; pass --host 0.0.0.0 to serve the cluster's network",
                file=sys.stderr,
                flush=True,
            )
    url = cluster.url
    if cluster.host in ("0.0.0.0", "::"):
        shown_url = f"http://{ray.util.get_node_ip_address()}:{cluster.port}"
    else:
        shown_url = url
    detached = False
    stop_watching = threading.Event()
    try:
        serve.start(
            http_options={"host": cluster.host, "port": cluster.port},
            logging_config={
                "enable_access_log": cluster.enable_log_requests,
                "log_level": cluster.log_level.upper(),
            },
        )
        serve.run(
            build_app_from_configs(engine, cluster, router),
            name=cluster.app_name,
            route_prefix="/",
            blocking=False,
        )
        if started_ray and cluster.support_nice:
            _lower_ray_system_priority_soon(cluster.support_nice)
        if detach:
            api_key = cluster.api_key or os.environ.get(API_KEY_ENV) or None
            try:
                wait_until_routable(url, api_key, DETACH_READY_TIMEOUT_S)
            except TimeoutError as exc:
                detached = True  # left in place to inspect ('serve status')
                print(f"prefixserve serve: error: {exc}; the app stays deployed", file=sys.stderr)
                return 1
            detached = True
            print(
                f"prefixserve: serving {engine.model} on {cluster.num_replicas} replica(s) at "
                f"{shown_url}/v1 (detached: 'serve delete {cluster.app_name}' stops it)",
                flush=True,
            )
            return 0
        print(
            f"prefixserve: serving {engine.model} on {cluster.num_replicas} replica(s) at "
            f"{shown_url}/v1 (Ctrl-C to stop)",
            flush=True,
        )
        if cluster.direct_ingress:
            _print_direct_ingress(cluster)
        ray_children = _child_pids() if started_ray else None
        _wait_for_signal()
        print("prefixserve: shutting down", flush=True)
        if ray_children:
            _exit_when_own_ray_ends(ray_children, stop_watching)
        _drain(cluster.app_name)
    finally:
        if detached:
            ray.shutdown()  # disconnects; Serve and the app live on in the cluster
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip cleanup
            try:
                serve.delete(cluster.app_name)
                if started_ray:
                    serve.shutdown()
            finally:
                stop_watching.set()  # ray.shutdown() ends the GCS itself
                ray.shutdown()
    print("prefixserve: stopped", flush=True)
    return 0


def _print_direct_ingress(cluster) -> None:
    """Prints each ingress replica's own URL (``--direct-ingress``) once all are up, or says
    that none came up in time."""
    from cluster.serve_compat import direct_ingress_targets

    deadline_s = time.monotonic() + DIRECT_INGRESS_WAIT_S
    targets: list[tuple[str, int]] = []
    while time.monotonic() < deadline_s:
        targets = direct_ingress_targets(cluster.app_name)
        if len(targets) >= cluster.ingress_replicas:
            break
        time.sleep(1.0)
    if not targets:
        print(
            "prefixserve: warning: --direct-ingress: no ingress replica serves a port of its own "
            f"after {DIRECT_INGRESS_WAIT_S:.0f}s (a running cluster needs "
            "RAY_SERVE_ENABLE_DIRECT_INGRESS=1 where it was started)",
            file=sys.stderr,
            flush=True,
        )
        return
    for node_ip, port in targets:  # each listens where the proxy does, at its own port
        host = node_ip if cluster.host in ("0.0.0.0", "::") else cluster.host
        print(f"prefixserve: direct ingress at http://{host}:{port}/v1", flush=True)


def _lower_ray_system_priority_soon(nice: int) -> None:
    """Lowers the local Ray's own processes (GCS, agents, Serve controller, proxy) below the
    engines, now and a few times more while Serve finishes starting its proxy."""

    def run() -> None:
        for delay_s in RAY_SYSTEM_RENICE_DELAYS_S:
            time.sleep(delay_s)
            pids = lower_ray_system_priority(nice)
            if pids:
                logging.getLogger(__name__).info(
                    "Ray system processes %s run at nice %d", pids, nice
                )

    threading.Thread(target=run, name="lower-ray-priority", daemon=True).start()


def _add_hooked_subcommands(subparsers) -> None:
    for hook in SUBCOMMAND_HOOKS:
        module_name, _, function_name = hook.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        getattr(module, function_name)(subparsers)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("prefixserve")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixserve", description="Prefix-cache-aware LLM serving on Ray Serve."
    )
    parser.add_argument("--version", action="version", version=f"prefixserve {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    _add_hooked_subcommands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.handler(ns)


if __name__ == "__main__":
    sys.exit(main())
