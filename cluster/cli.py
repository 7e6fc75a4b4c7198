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
import dataclasses
import importlib
import logging
import math
import os
import signal
import sys
import threading
import time

from cluster.config import API_KEY_ENV, ClusterConfig, configs_from_args
from cluster.priority import lower_ray_system_priority
from router.config import RouterConfig
from worker.config import EngineConfig

# On Ctrl-C, in-flight requests get this long to finish before they are aborted.
DRAIN_TIMEOUT_S = 5.0
# A call to the metrics hub during shutdown; it answers in milliseconds unless wedged.
DRAIN_CALL_TIMEOUT_S = 5.0
# --detach: model download and load on the cluster, then Serve's health checks; a one-token
# completion then proves the app routes (each probe waits this long for its answer).
DETACH_READY_TIMEOUT_S = 1800.0
READY_PROBE_TIMEOUT_S = 60.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"
RAY_SYSTEM_RENICE_DELAYS_S = (0.0, 2.0, 5.0, 10.0, 30.0)
"""Ray's setting for the niceness of the worker processes it starts (its default is 15)."""
# Other modules add subcommands by exposing ``add_parser(subparsers)`` that registers a
# parser whose defaults set ``handler`` (a function of the parsed namespace returning an exit
# code). A hook whose module is not there yet is skipped.
SUBCOMMAND_HOOKS = ("cluster.batch:add_parser", "bench.cli:add_parser")

# The help's argument groups, in order; a table row names its group by key.
GROUPS = {
    "model": "model",
    "engine": "engine & KV cache",
    "parallel": "parallelism & placement",
    "http": "HTTP server",
    "routing": "routing",
    "logging": "logging & metrics",
}
# The group of a row that names none (a 5-tuple), by section.
SECTION_GROUPS = {"engine": "engine", "cluster": "http", "router": "routing"}
SECTION_CLASSES = {"engine": EngineConfig, "cluster": ClusterConfig, "router": RouterConfig}
LIST = "list"
"""Row type of a comma-separated list flag (repeating the flag adds to the list)."""

# (flag, section, field, type, help[, group]). type None marks a --x/--no-x boolean, LIST a
# list. Help strings never state a default: ``_help`` appends the dataclass field's own
# (a None default is explained in words where it means something).
_FLAGS = [
    # model
    (
        "--model", "engine", "model", str,
        "Hugging Face folder or hub id, .gguf file, or 'smollm2' (bundled). Also positional: "
        "prefixserve serve MODEL.",
        "model",
    ),
    (
        "--served-model-name", "cluster", "served_model_name", str,
        "Model name in the API (default: the model's id).",
        "model",
    ),
    (
        "--tokenizer", "engine", "tokenizer", str,
        "Tokenizer folder or hub id (default: the model's).",
        "model",
    ),
    (
        "--revision", "engine", "revision", str,
        "Hub revision (branch, tag or commit) of a hub model.",
        "model",
    ),
    (
        "--download-dir", "engine", "download_dir", str,
        "Where hub models are downloaded (default: the Hugging Face cache).",
        "model",
    ),
    (
        "--chat-template", "engine", "chat_template", str,
        "Jinja chat template (a file or the template itself) replacing the model's.",
        "model",
    ),
    (
        "--enable-auto-tool-choice", "cluster", "enable_auto_tool_choice", None,
        "Allow tool_choice 'auto' (the default when a request has tools); needs "
        "--tool-call-parser.",
        "model",
    ),
    (
        "--tool-call-parser", "cluster", "tool_call_parser", str,
        "How output becomes tool_calls: hermes (Hermes, Qwen) or llama3_json (default: hermes for "
        "'required' and named choice; no 'auto').",
        "model",
    ),
    (
        "--generation-config", "engine", "generation_config", str,
        "Sampling defaults: 'auto' (the model's generation_config.json), 'vllm' (none) or a "
        "folder holding one.",
        "model",
    ),
    (
        "--max-model-len", "engine", "max_model_len", int,
        "Context limit in tokens (default: the model's).",
        "model",
    ),
    (
        "--dtype", "engine", "dtype", str,
        "Weights and activations: float32, float16, bfloat16 or auto (float32 on CPU; bfloat16 on "
        "CUDA from compute capability 8.0, else float16).",
        "model",
    ),
    # engine & KV cache
    (
        "--block-size", "engine", "block_size", int,
        "Tokens per KV block and per hashed prefix block.",
        "engine",
    ),
    (
        "--max-num-seqs", "engine", "max_num_seqs", int,
        "Most requests running at once per replica.",
        "engine",
    ),
    (
        "--max-num-batched-tokens", "engine", "max_num_batched_tokens", int,
        "Token budget of one engine step.",
        "engine",
    ),
    (
        "--enable-prefix-caching", "engine", "enable_prefix_caching", None,
        "Reuse KV blocks of shared prefixes.",
        "engine",
    ),
    (
        "--num-kv-blocks", "engine", "num_kv_blocks", int,
        "KV cache size in blocks (one KV size knob of four).",
        "engine",
    ),
    ("--kv-cache-bytes", "engine", "kv_cache_bytes", int, "KV cache size in bytes.", "engine"),
    (
        "--kv-cache-memory-fraction", "engine", "kv_cache_memory_fraction", float,
        "KV cache as a fraction of the memory left after the weights (the knob in force when none "
        "is given).",
        "engine",
    ),
    (
        "--gpu-memory-utilization", "engine", "gpu_memory_utilization", float,
        "CUDA: fraction of the device's memory for weights, activations and KV together.",
        "engine",
    ),
    (
        "--host-kv-cache-bytes", "engine", "host_kv_cache_bytes", int,
        "Second KV tier in host RAM for evicted prefix blocks, in bytes (default: off).",
        "engine",
    ),
    (
        "--kernel-backend", "engine", "kernel_backend", str,
        "auto (triton on CUDA, torch on CPU), torch or triton.",
        "engine",
    ),
    ("--seed", "engine", "seed", int, "Seed for requests that give none.", "engine"),
    ("--deterministic", "engine", "deterministic", None, "Batch-invariant numerics.", "engine"),
    (
        "--max-waiting-requests", "engine", "max_waiting_requests", int,
        "Engine queue bound per replica; past it: 429.",
        "engine",
    ),
    (
        "--max-logprobs", "engine", "max_logprobs", int,
        "Most logprobs a request may ask for.",
        "engine",
    ),
    (
        "--num-threads", "engine", "num_threads", int,
        "torch intra-op threads per engine replica on CPU (default: torch's choice).",
        "engine",
    ),
    # parallelism & placement
    (
        "--device", "engine", "device", str,
        "cpu, cuda[:N] or auto (cuda when the replica sees a GPU; the replicas reserve GPUs when "
        "the Ray cluster has any, decided at deploy time).",
        "parallel",
    ),
    (
        "--tensor-parallel-size", "engine", "tensor_parallel_size", int,
        "Ranks each replica's model is split over, one placement-group bundle (and GPU on CUDA) "
        "each.",
        "parallel",
    ),
    ("--num-replicas", "cluster", "num_replicas", int, "Engine replicas.", "parallel"),
    (
        "--num-cpus-per-replica", "cluster", "num_cpus_per_replica", float,
        "Ray CPUs per engine replica (per rank under tensor parallelism).",
        "parallel",
    ),
    (
        "--num-gpus-per-replica", "cluster", "num_gpus_per_replica", float,
        "Ray GPUs per engine replica (per rank under tensor parallelism; default: 1 on CUDA, else "
        "0).",
        "parallel",
    ),
    (
        "--num-ingress-replicas", "cluster", "num_ingress_replicas", int,
        "HTTP ingress replicas (parse, template, tokenize, route; no CPU reserved); the minimum "
        "when autoscaling (default: 2 with more than one engine replica, else 1).",
        "parallel",
    ),
    (
        "--max-ingress-replicas", "cluster", "max_ingress_replicas", int,
        "Autoscale the ingress up to this many replicas (default: a fixed count).",
        "parallel",
    ),
    (
        "--ingress-target-ongoing-requests", "cluster", "ingress_target_ongoing_requests", float,
        "Ingress autoscaling target: open requests per ingress replica.",
        "parallel",
    ),
    (
        "--address", "cluster", "ray_address", str,
        "Join this Ray cluster ('auto', host:port, ray://...) instead of starting a local one.",
        "parallel",
    ),
    # HTTP server
    (
        "--host", "cluster", "host", str,
        "HTTP host; 0.0.0.0 to be reachable from other machines (a Ray job on a cluster).",
        "http",
    ),
    ("--port", "cluster", "port", int, "HTTP port.", "http"),
    (
        "--api-key", "cluster", "api_key", str,
        f"Require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none).",
        "http",
    ),
    (
        "--root-path", "cluster", "root_path", str,
        "FastAPI root_path, for a proxy that serves the API under a path prefix.",
        "http",
    ),
    (
        "--allowed-origins", "cluster", "allowed_origins", LIST,
        "CORS: origins allowed to call the API, comma-separated ('*': any; default: none, no "
        "CORS).",
        "http",
    ),
    (
        "--allowed-methods", "cluster", "allowed_methods", LIST,
        "CORS: methods allowed cross-origin.",
        "http",
    ),
    (
        "--allowed-headers", "cluster", "allowed_headers", LIST,
        "CORS: request headers allowed cross-origin.",
        "http",
    ),
    (
        "--max-ongoing-requests", "cluster", "max_ongoing_requests", int,
        "Requests in flight per engine replica.",
        "http",
    ),
    (
        "--max-queued-requests", "cluster", "max_queued_requests", int,
        "Requests queued for a free replica; past it: 429.",
        "http",
    ),
    (
        "--max-request-body-bytes", "cluster", "max_request_body_bytes", int,
        "Larger bodies get 413.",
        "http",
    ),
    (
        "--stream-interval", "cluster", "stream_interval", int,
        "Tokens per streamed message from a replica; more send fewer, larger messages and stream "
        "in bursts.",
        "http",
    ),
    (
        "--support-nice", "cluster", "support_nice", int,
        "Nice steps below the engines for every other serving process (ingress, relays, "
        "metrics, a local Ray's own), so they yield the cores to the engines; 0: no change.",
        "parallel",
    ),
    # routing
    ("--routing", "router", "policy", str, "prefix, round_robin, least_loaded or pow2.", "routing"),
    (
        "--max-load-ratio", "router", "max_load_ratio", float,
        "prefix routing: a replica takes a request only while its recent share stays within this "
        "multiple of the mean.",
        "routing",
    ),
    (
        "--speculative-ttl-s", "router", "speculative_ttl_s", float,
        "prefix routing: how long a routed prefix counts as held before its KV events arrive "
        "(raise it where one prefill takes longer).",
        "routing",
    ),
    (
        "--kv-pull-tokens-per-s", "router", "kv_pull_tokens_per_s", float,
        "prefix routing: a replica lacking a prefix that a peer holds pulls its KV from the peer "
        "instead of prefilling it, priced at this many tokens per second (default: no pulls).",
        "routing",
    ),
    (
        "--redis-url", "router", "redis_url", str,
        "Use Redis at this URL as the prefix index (default: embedded).",
        "routing",
    ),
    # logging & metrics
    (
        "--log-level", "cluster", "log_level", str,
        "Log level of the driver, the deployments and the engine processes: debug, info, warning, "
        "error or critical.",
        "logging",
    ),
    (
        "--enable-log-requests", "cluster", "enable_log_requests", None,
        "Log one line per request (Serve's access log).",
        "logging",
    ),
    (
        "--expose-replica-headers", "cluster", "expose_replica_headers", None,
        "Name the serving engine and ingress replicas in "
        "x-prefixserve-replica/x-prefixserve-ingress response headers (for debugging and "
        "benchmarks; they reveal the cluster's layout).",
        "http",
    ),
    (
        "--metrics-prefix", "cluster", "metrics_prefix", str,
        "Prefix of the series names at /metrics; 'vllm' gives vLLM's names for its dashboards and "
        "autoscaling rules.",
        "logging",
    ),
]  # fmt: skip


def _rows() -> list[tuple]:
    """The table as 6-tuples (a row without a group gets its section's)."""
    return [row if len(row) > 5 else (*row, SECTION_GROUPS[row[1]]) for row in _FLAGS]


def field_default(section: str, field: str):
    """A config field's default, read from its dataclass (the one place defaults live)."""
    for f in dataclasses.fields(SECTION_CLASSES[section]):
        if f.name == field:
            if f.default is not dataclasses.MISSING:
                return f.default
            return f.default_factory()  # type: ignore[misc]
    raise KeyError(f"{section}.{field}")


def _help(section: str, field: str, kind, help_text: str) -> str:
    default = field_default(section, field)
    if default is None or default in ((), ""):
        return help_text  # the text says what unset means
    if kind is None:
        shown = "on" if default else "off"
    elif kind == LIST:
        shown = ",".join(default)
    else:
        shown = str(default)
    text = help_text[:-1] if help_text.endswith(".") else help_text
    return f"{text} (default: {shown}).".replace("%", "%%")


def _list_arg(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="Serve an OpenAI-compatible API on a Ray Serve cluster.",
        description="Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, ...) "
        "on Ray Serve. With no flags: the bundled SmolLM2 model on 2 CPU replicas at "
        "http://127.0.0.1:8000.",
    )
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="The model (same as --model)."
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flags (keys as the flags without '--', dashes or underscores); "
        "flags on the command line win.",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="With --address: deploy, wait until the API answers, print its URL and exit 0, "
        "leaving the app serving (stop it with 'serve delete' or 'serve shutdown').",
    )
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for flag, section, field, kind, help_text, group in _rows():
        text = _help(section, field, kind, help_text)
        if kind is None:
            groups[group].add_argument(
                flag, dest=field, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        elif kind == LIST:
            groups[group].add_argument(
                flag, dest=field, type=_list_arg, action="extend", default=None, help=text
            )
        else:
            groups[group].add_argument(flag, dest=field, type=kind, default=None, help=text)
    parser.set_defaults(handler=run_serve)
    return parser


def _coerce(key: str, kind, value):
    """A config file's value in the flag's type; ValueError naming the key."""
    if kind is None:
        ok = isinstance(value, bool)
    elif kind == LIST:
        if isinstance(value, str):
            value = _list_arg(value)
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif kind is str:
        ok = isinstance(value, str)
    elif isinstance(value, str):
        try:
            value, ok = kind(value), True
        except ValueError:
            ok = False
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and (kind is float or isinstance(value, int))
    if not ok:
        raise ValueError(
            f"{key}: expected {getattr(kind, '__name__', kind or 'bool')}, got {value!r}"
        )
    return float(value) if kind is float else value


def config_file_values(path: str) -> dict:
    """``{dest: value}`` from a YAML file of flags (``max-num-seqs: 8`` or ``max_num_seqs: 8``);
    ValueError naming the file and the key for an unknown key or a wrong type."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a mapping of flags to values")
    rows = {}
    for row in _rows():
        rows[row[0][2:].replace("-", "_")] = row
        rows[row[2]] = row
    values = {}
    for key, value in data.items():
        row = rows.get(str(key).replace("-", "_"))
        if row is None:
            raise ValueError(
                f"--config {path}: unknown key {key!r} (keys are the flags without '--')"
            )
        if value is not None:
            try:
                values[row[2]] = _coerce(str(key), row[3], value)
            except ValueError as exc:
                raise ValueError(f"--config {path}: {exc}") from None
    return values


def merge_command_line(ns: argparse.Namespace) -> argparse.Namespace:
    """The positional model and the ``--config`` file folded into the flags: a flag given on
    the command line wins over the file; a positional model that disagrees with --model is a
    ValueError."""
    ns = argparse.Namespace(**vars(ns))
    tag = getattr(ns, "model_tag", None)
    if tag is not None:
        if ns.model is not None and ns.model != tag:
            raise ValueError(f"the positional model {tag!r} disagrees with --model {ns.model!r}")
        ns.model = tag
    if getattr(ns, "config", None):
        for dest, value in config_file_values(ns.config).items():
            if getattr(ns, dest, None) is None:
                setattr(ns, dest, value)
    return ns


def args_from_namespace(ns: argparse.Namespace) -> dict:
    """The builder's args (``{"engine", "cluster", "router"}``) from the flags that were given."""
    ns = merge_command_line(ns)
    args: dict = {"engine": {}, "cluster": {}, "router": {}}
    for _, section, field, *_ in _FLAGS:
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

    from cluster.app import build_app_from_configs

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
        _wait_for_signal()
        print("prefixserve: shutting down", flush=True)
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
                ray.shutdown()
    print("prefixserve: stopped", flush=True)
    return 0


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
