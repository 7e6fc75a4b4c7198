"""The ``prefixserve`` command: ``serve`` here; other subcommands plug in via ``SUBCOMMAND_HOOKS``.

``prefixserve serve`` maps its flags onto ``EngineConfig``/``ClusterConfig``/``RouterConfig``
(vLLM's flag names where the meaning is the same; a flag left out keeps the dataclass
default), validates them before touching Ray (a bad flag exits with status 2 and the
message naming the field), starts a local Ray instance or joins ``--address``, runs the
application and blocks until SIGINT/SIGTERM. Then it drains (in-flight requests get
``DRAIN_TIMEOUT_S`` to finish; the rest end with finish_reason ``abort`` and ``[DONE]``),
deletes the application and, if it started Ray itself, shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import signal
import sys
import threading

from cluster.config import API_KEY_ENV, DEFAULT_MAX_QUEUED_REQUESTS, configs_from_args

# On Ctrl-C, in-flight requests get this long to finish before they are aborted.
DRAIN_TIMEOUT_S = 5.0
# A call to the metrics hub during shutdown; it answers in milliseconds unless wedged.
DRAIN_CALL_TIMEOUT_S = 5.0
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"
"""Ray's setting for the niceness of the worker processes it starts (its default is 15)."""
# Other modules add subcommands by exposing ``add_parser(subparsers)`` that registers a
# parser whose defaults set ``handler`` (a function of the parsed namespace returning an exit
# code). A hook whose module is not there yet is skipped.
SUBCOMMAND_HOOKS = ("cluster.batch:add_parser", "bench.cli:add_parser")

# (flag, section, field, type, help). type None marks a --x/--no-x boolean.
_FLAGS = [
    (
        "--model",
        "engine",
        "model",
        str,
        "Hugging Face folder, .gguf file or 'smollm2' (bundled; default).",
    ),
    (
        "--served-model-name",
        "cluster",
        "served_model_name",
        str,
        "Model name in the API (default: the model's id).",
    ),
    (
        "--block-size",
        "engine",
        "block_size",
        int,
        "Tokens per KV block and per hashed prefix block (default 16).",
    ),
    (
        "--max-model-len",
        "engine",
        "max_model_len",
        int,
        "Context limit in tokens (default: the model's).",
    ),
    (
        "--max-num-seqs",
        "engine",
        "max_num_seqs",
        int,
        "Most requests running at once per replica (default 64).",
    ),
    (
        "--max-num-batched-tokens",
        "engine",
        "max_num_batched_tokens",
        int,
        "Token budget of one engine step (default 512).",
    ),
    (
        "--enable-prefix-caching",
        "engine",
        "enable_prefix_caching",
        None,
        "Reuse KV blocks of shared prefixes (default on).",
    ),
    (
        "--num-kv-blocks",
        "engine",
        "num_kv_blocks",
        int,
        "KV cache size in blocks (exclusive with the next two).",
    ),
    ("--kv-cache-bytes", "engine", "kv_cache_bytes", int, "KV cache size in bytes."),
    (
        "--kv-cache-memory-fraction",
        "engine",
        "kv_cache_memory_fraction",
        float,
        "KV cache as a fraction of free memory (default 0.2).",
    ),
    (
        "--host-kv-cache-bytes",
        "engine",
        "host_kv_cache_bytes",
        int,
        "Second KV tier in host RAM for evicted prefix blocks, in bytes (default off).",
    ),
    (
        "--tensor-parallel-size",
        "engine",
        "tensor_parallel_size",
        int,
        "Ranks each replica's model is split over, one placement-group bundle each (default 1).",
    ),
    ("--kernel-backend", "engine", "kernel_backend", str, "auto (default: triton on CUDA, torch on CPU), torch or triton."),
    ("--dtype", "engine", "dtype", str, "float32 (default on CPU), float16 or bfloat16."),
    ("--device", "engine", "device", str, "cpu (default) or cuda."),
    ("--seed", "engine", "seed", int, "Seed for requests that give none (default 0)."),
    ("--deterministic", "engine", "deterministic", None, "Batch-invariant numerics (default on)."),
    (
        "--max-waiting-requests",
        "engine",
        "max_waiting_requests",
        int,
        "Engine queue bound per replica; past it: 429 (default 1024).",
    ),
    ("--host", "cluster", "host", str, "HTTP host (default 127.0.0.1)."),
    ("--port", "cluster", "port", int, "HTTP port (default 8000)."),
    (
        "--api-key",
        "cluster",
        "api_key",
        str,
        f"Require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none).",
    ),
    ("--num-replicas", "cluster", "num_replicas", int, "Engine replicas (default 2)."),
    (
        "--max-ongoing-requests",
        "cluster",
        "max_ongoing_requests",
        int,
        "Requests in flight per replica (default 128).",
    ),
    (
        "--max-queued-requests",
        "cluster",
        "max_queued_requests",
        int,
        f"Requests queued for a free replica; past it: 429 (default {DEFAULT_MAX_QUEUED_REQUESTS}).",
    ),
    (
        "--max-request-body-bytes",
        "cluster",
        "max_request_body_bytes",
        int,
        "Larger bodies get 413 (default 1 MiB).",
    ),
    (
        "--num-cpus-per-replica",
        "cluster",
        "num_cpus_per_replica",
        float,
        "Ray CPUs per engine replica (default 1).",
    ),
    (
        "--num-gpus-per-replica",
        "cluster",
        "num_gpus_per_replica",
        float,
        "Ray GPUs per engine replica (default 0).",
    ),
    (
        "--address",
        "cluster",
        "ray_address",
        str,
        "Join this Ray cluster instead of starting a local one.",
    ),
    (
        "--num-threads",
        "engine",
        "num_threads",
        int,
        "torch intra-op threads per engine replica on CPU (default: torch's choice).",
    ),
    (
        "--stream-interval",
        "cluster",
        "stream_interval",
        int,
        "Tokens per streamed message from a replica; more send fewer, larger messages and "
        "stream in bursts (default 1).",
    ),
    (
        "--enable-log-requests",
        "cluster",
        "enable_log_requests",
        None,
        "Log one line per request (Serve's access log; default off).",
    ),
    ("--routing", "router", "policy", str, "prefix (default), round_robin, least_loaded or pow2."),
    (
        "--max-load-ratio",
        "router",
        "max_load_ratio",
        float,
        "prefix routing: a replica takes a request only while its recent share stays within "
        "this multiple of the mean (default 1.1).",
    ),
    (
        "--speculative-ttl-s",
        "router",
        "speculative_ttl_s",
        float,
        "prefix routing: how long a routed prefix counts as held before its KV events arrive "
        "(default 5; raise it where one prefill takes longer).",
    ),
    (
        "--redis-url",
        "router",
        "redis_url",
        str,
        "Use Redis at this URL as the prefix index (default: embedded).",
    ),
]


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="Serve an OpenAI-compatible API on a Ray Serve cluster.",
        description="Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, ...) "
        "on Ray Serve. With no flags: the bundled SmolLM2 model on 2 CPU replicas at "
        "http://127.0.0.1:8000.",
    )
    for flag, _, field, kind, help_text in _FLAGS:
        if kind is None:
            parser.add_argument(
                flag,
                dest=field,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(flag, dest=field, type=kind, default=None, help=help_text)
    parser.set_defaults(handler=run_serve)
    return parser


def args_from_namespace(ns: argparse.Namespace) -> dict:
    """The builder's args (``{"engine", "cluster", "router"}``) from the flags that were given."""
    args: dict = {"engine": {}, "cluster": {}, "router": {}}
    for _, section, field, _, _ in _FLAGS:
        value = getattr(ns, field, None)
        if value is not None:
            args[section][field] = value
    if "api_key" not in args["cluster"] and os.environ.get(API_KEY_ENV):
        args["cluster"]["api_key"] = os.environ[API_KEY_ENV]
    if "redis_url" in args["router"]:
        args["router"]["index_backend"] = "redis"
    return args


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def _drain(app_name: str) -> None:
    """Lets in-flight requests finish for ``DRAIN_TIMEOUT_S``, then has the replicas abort
    the rest, so every open stream ends with a final chunk and ``[DONE]``."""
    import time

    from ray import serve

    from cluster.metrics import METRICS_PUSH_PERIOD_S, num_busy_requests

    try:
        hub = serve.get_deployment_handle("MetricsHub", app_name)
        hub.begin_drain.remote(DRAIN_TIMEOUT_S).result(timeout_s=DRAIN_CALL_TIMEOUT_S)
        # Replicas learn of the drain on their next push and report idle on the one after.
        deadline_s = time.monotonic() + DRAIN_TIMEOUT_S + 3 * METRICS_PUSH_PERIOD_S
        time.sleep(2 * METRICS_PUSH_PERIOD_S)
        while time.monotonic() < deadline_s:
            snapshots = hub.snapshots.remote().result(timeout_s=DRAIN_CALL_TIMEOUT_S)
            if num_busy_requests(snapshots) == 0:
                return
            time.sleep(METRICS_PUSH_PERIOD_S / 2)
    except Exception as exc:  # draining is a courtesy; shutdown goes on regardless
        print(f"prefixserve: drain skipped: {exc!r}", file=sys.stderr, flush=True)


def run_serve(ns: argparse.Namespace) -> int:
    try:
        engine, cluster, router = configs_from_args(args_from_namespace(ns))
    except ValueError as exc:
        print(f"prefixserve serve: error: {exc}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from cluster.app import build_app_from_configs

    started_ray = cluster.ray_address is None
    if started_ray:
        # Logical CPUs, not cores: the replicas' CPU reservations must fit even on a small
        # machine (the engines then share its cores).
        needed = math.ceil(cluster.num_replicas * cluster.num_cpus_per_replica * engine.tensor_parallel_size) + 1
        # Ray starts its workers at nice 15 by default, below any process of the user's (a
        # client, a peer server) that competes for the cores; the engine replicas are the work.
        os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")
        # A local cluster stays on loopback: nothing it runs listens on another address.
        ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False, _node_ip_address="127.0.0.1")
    else:
        ray.init(address=cluster.ray_address)
    try:
        serve.start(
            http_options={"host": cluster.host, "port": cluster.port},
            logging_config={"enable_access_log": cluster.enable_log_requests},
        )
        serve.run(
            build_app_from_configs(engine, cluster, router),
            name=cluster.app_name,
            route_prefix="/",
            blocking=False,
        )
        print(
            f"prefixserve: serving {engine.model} on {cluster.num_replicas} replica(s) at "
            f"{cluster.url}/v1 (Ctrl-C to stop)",
            flush=True,
        )
        _wait_for_signal()
        print("prefixserve: shutting down", flush=True)
        _drain(cluster.app_name)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip cleanup
        try:
            serve.delete(cluster.app_name)
            if started_ray:
                serve.shutdown()
        finally:
            ray.shutdown()
    print("prefixserve: stopped", flush=True)
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixserve", description="Prefix-cache-aware LLM serving on Ray Serve."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    _add_hooked_subcommands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.handler(ns)


if __name__ == "__main__":
    sys.exit(main())
