"""``ClusterConfig``: how the Serve application is laid out and exposed, validated once.

The engine's knobs live in ``worker.config.EngineConfig`` and the router's in
``router.config.RouterConfig``; this dataclass owns the rest: how many engine replicas run,
how many requests each may hold, the HTTP address, the optional API key and the request
limits that keep a bad or oversized request from harming anyone else. Construction fails
with a ``ValueError`` naming the offending field (``ClusterConfig.<field>: ...``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from cluster.priority import MAX_NICE, SUPPORT_NICE_DEFAULT
from cluster.tool_parsers import TOOL_CALL_STREAMS
from router.config import RouterConfig
from worker.config import EngineConfig

# One MiB of JSON holds far more prompt than any supported context (a 32k-token context is
# roughly 128 KiB of text); larger bodies are almost surely mistakes or abuse.
DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20
# Twice the engine's default max_num_seqs (64): enough in-flight requests per replica to keep
# its batch full while the next ones wait in the engine's own queue.
DEFAULT_MAX_ONGOING_REQUESTS = 128
# Requests Serve's handles may hold back when every replica is at max_ongoing_requests;
# past this the ingress answers 429 instead of letting the queue (and latency) grow unbounded.
DEFAULT_MAX_QUEUED_REQUESTS = 512
DEFAULT_PORT = 8000
# An ingress replica holds each request for its whole stream, but its CPU work (parse,
# template, tokenize, hash) comes at the start; autoscaling adds one per this many streams.
DEFAULT_INGRESS_TARGET_ONGOING_REQUESTS = 256.0
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
HANDLE_TRANSPORTS = ("grpc", "ray")
# Where the ingress (and the CLI) look for the API key when the config gives none, so the key
# need not appear in Serve config files or the dashboard.
API_KEY_ENV = "PREFIXSERVE_API_KEY"
TOOL_CALL_PARSERS = tuple(TOOL_CALL_STREAMS)
SECTIONS = ("engine", "cluster", "router")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ClusterConfig:
    num_replicas: int = 2
    """Engine replicas (one engine each)."""
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS
    """Requests Serve sends to one replica at once; keep it >= the engine's max_num_seqs."""
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS
    """Requests queued in Serve's handles beyond that; more get 429. None: unbounded."""
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    """When set (or when the ingress finds ``$PREFIXSERVE_API_KEY``), /v1/*, /tokenize and
    /detokenize need ``Authorization: Bearer <api_key>``; /health and /metrics stay open."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """Bodies larger than this get 413."""
    ray_address: str | None = None
    """Join this Ray cluster (``auto``, ``ray://...``, ``host:port``); None starts a local one."""
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float | None = None
    """Ray GPUs of each engine replica and, under tensor parallelism, of each rank's bundle.
    None: 1 on CUDA (and on ``device: auto`` when the Ray cluster has GPUs), else 0."""
    num_ingress_replicas: int | None = None
    """Ingress replicas (FastAPI: parse, template, tokenize, route; no CPU reserved); the
    minimum when autoscaling. None: 2 when more than one engine replica runs, else 1."""
    max_ingress_replicas: int | None = None
    """Above ``num_ingress_replicas``: Serve autoscales the ingress up to this many replicas."""
    ingress_target_ongoing_requests: float = DEFAULT_INGRESS_TARGET_ONGOING_REQUESTS
    """Autoscaling target: open requests (streams) per ingress replica."""
    allowed_origins: tuple[str, ...] = ()
    """CORS: browser origins allowed to call the API (``*``: any); empty: no CORS headers."""
    allowed_methods: tuple[str, ...] = ("*",)
    """CORS: HTTP methods allowed cross-origin (with ``allowed_origins``)."""
    allowed_headers: tuple[str, ...] = ("*",)
    """CORS: request headers allowed cross-origin (with ``allowed_origins``)."""
    root_path: str = ""
    """FastAPI's root_path: the path prefix a proxy in front serves the API under."""
    log_level: str = "info"
    """Log level of the driver, the Serve deployments and the engine processes."""
    served_model_name: str | None = None
    """Model name in the API; defaults to the engine's model id."""
    app_name: str = "prefixserve"
    """Serve application name (several apps may share one Ray cluster)."""
    stream_interval: int = 1
    """Tokens per streamed message from an engine replica (vLLM's ``--stream-interval``): more
    send fewer, larger messages (to the ingress, then through Serve's proxy) and stream in
    bursts. A request's first tokens and its end go at once."""
    push_outputs: bool = True
    """Engine replicas push a request's outputs between its first and its last to the ingress
    replica that called them, every request's in one frame per engine step on a TCP
    connection to a port each ingress replica opens on its node (``cluster/push_socket.py``),
    instead of one streamed item per output; False streams every output through the
    request's own handle call."""
    handle_transport: str = "grpc"
    """How the ingress's calls to the engine replicas travel: ``grpc``, Ray Serve's gRPC
    channel between replicas (each call a gRPC stream, its outputs pickled onto it), or
    ``ray``, Ray actor calls (each streamed output a Ray object). gRPC costs the ingress and
    the replica less CPU per request and per streamed output. A local cluster (no
    ``ray_address``) also gets Serve's proxy on gRPC to the ingress; a running cluster's proxy
    keeps what it was started with (``RAY_SERVE_PROXY_USE_GRPC``). A Ray whose Serve has no
    gRPC transport (2.50) calls by actor calls either way, with a warning."""
    engine_cpu_affinity: bool = False
    """Each engine process may claim CPUs of its own on its node, as many as its replica
    reserves in Ray (``num_cpus_per_replica``, whole CPUs) and its loop uses (one for the
    simulated engine, ``num_threads`` for a CPU engine; none on CUDA): pinned there, with the
    ingress, the replicas' relays, the index and the hub kept off them. A claim that would
    leave the node no unclaimed CPU is not made (``worker/cpu_claims.py``). A claimed CPU is the
    engine's even while it idles, which slows what the rest of a small node does meanwhile
    (a cluster starting beside it), so it is off by default: turn it on for an engine that is
    busy most of the time on a node with cores to spare."""
    support_nice: int = SUPPORT_NICE_DEFAULT
    """Nice steps (0-19, as ``nice -n``) below the engines for the processes off the request
    path: the metrics hub and, for a local cluster, Ray's GCS, agents and Serve controller.
    They then yield the cores to an engine that wants them (``cluster/priority.py``); the
    proxy, ingress, relays and index stay at the engines' priority. 0 leaves all alone."""
    enable_log_requests: bool = False
    direct_ingress: bool = False
    """Each ingress replica also serves HTTP on a port of its own (Ray Serve's direct
    ingress: 30000 and up on its node, at ``host``), so a client or load balancer that calls it
    skips Serve's proxy, one Ray hop per streamed message; the proxy at ``port`` still serves.
    A local cluster (no ``ray_address``) is started with it; a running cluster must have been
    started with ``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``."""
    expose_replica_headers: bool = False
    """Send ``x-prefixserve-replica`` and ``x-prefixserve-ingress`` (the engine and ingress
    replicas that served a request) on every response. Off by default: they tell clients how
    the cluster is laid out and which replica holds which prefix; turn them on to debug or
    benchmark routing."""
    """Log one line per HTTP request (Serve's access log) in the proxy, ingress and replicas.
    Off by default, as in vLLM: on a small machine the log lines cost serving throughput."""
    metrics_prefix: str = "prefixserve:"
    """Prefix of every series name at ``/metrics`` (a trailing ``:`` is added when missing):
    ``vllm`` gives vLLM's names, so its dashboards and autoscaling rules read ours unchanged."""
    enable_auto_tool_choice: bool = False
    """Allow ``tool_choice: "auto"`` (the default when a request has tools), as vLLM's flag;
    needs ``tool_call_parser``. ``required`` and a named function work without it."""
    strict_json_schema: bool = True
    """JSON schemas of ``response_format``, ``structured_outputs``/``guided_json`` and tool
    parameters allow no property they do not list unless they say otherwise
    (``additionalProperties``), as OpenAI's strict mode and vLLM do; False keeps plain JSON
    Schema semantics, where an unlisted key is allowed."""
    tool_call_parser: str | None = None
    """How model output becomes ``tool_calls`` (vLLM's names): ``hermes`` or ``llama3_json``.
    None: ``hermes`` for ``required``/named choice, and no ``auto``."""

    def __post_init__(self) -> None:
        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"ClusterConfig.{field}: {msg}")

        for field in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, field)
            if isinstance(value, str):  # "a,b" from a config file or an env variable
                value = [part.strip() for part in value.split(",") if part.strip()]
            need(
                isinstance(value, (list, tuple))
                and all(isinstance(v, str) and v.strip() for v in value),
                field,
                f"must be a list of non-empty strings, got {value!r}",
            )
            object.__setattr__(self, field, tuple(value))
        if isinstance(self.log_level, str):
            object.__setattr__(self, "log_level", self.log_level.lower())

        need(
            _is_int(self.num_replicas) and self.num_replicas >= 1,
            "num_replicas",
            f"must be an integer >= 1, got {self.num_replicas!r}",
        )
        need(
            _is_int(self.max_ongoing_requests) and self.max_ongoing_requests >= 1,
            "max_ongoing_requests",
            f"must be an integer >= 1, got {self.max_ongoing_requests!r}",
        )
        need(
            self.max_queued_requests is None
            or (_is_int(self.max_queued_requests) and self.max_queued_requests >= 1),
            "max_queued_requests",
            f"must be None or an integer >= 1, got {self.max_queued_requests!r}",
        )
        need(isinstance(self.host, str) and bool(self.host), "host", "must be a non-empty string")
        need(
            _is_int(self.port) and 0 < self.port < 65536,
            "port",
            f"must be an integer in [1, 65535], got {self.port!r}",
        )
        need(
            self.api_key is None or (isinstance(self.api_key, str) and bool(self.api_key)),
            "api_key",
            "must be None or a non-empty string",
        )
        need(
            _is_int(self.max_request_body_bytes) and self.max_request_body_bytes >= 1024,
            "max_request_body_bytes",
            f"must be an integer >= 1024, got {self.max_request_body_bytes!r}",
        )
        need(
            _is_int(self.support_nice) and 0 <= self.support_nice <= MAX_NICE,
            "support_nice",
            f"must be an integer from 0 to {MAX_NICE}, got {self.support_nice!r}",
        )
        need(
            _is_int(self.stream_interval) and self.stream_interval >= 1,
            "stream_interval",
            f"must be an integer >= 1, got {self.stream_interval!r}",
        )
        need(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            "tool_call_parser",
            f"must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}",
        )
        need(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "enable_auto_tool_choice",
            "needs tool_call_parser (--tool-call-parser) to say how calls are written",
        )
        need(
            isinstance(self.metrics_prefix, str)
            and re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*:?", self.metrics_prefix) is not None,
            "metrics_prefix",
            f"must be a Prometheus name prefix like 'vllm' or 'prefixserve:', "
            f"got {self.metrics_prefix!r}",
        )
        need(
            self.ray_address is None
            or (isinstance(self.ray_address, str) and bool(self.ray_address)),
            "ray_address",
            "must be None or a non-empty string",
        )
        need(
            _is_number(self.num_cpus_per_replica) and self.num_cpus_per_replica >= 0,
            "num_cpus_per_replica",
            f"must be a number >= 0, got {self.num_cpus_per_replica!r}",
        )
        need(
            self.num_gpus_per_replica is None
            or (_is_number(self.num_gpus_per_replica) and self.num_gpus_per_replica >= 0),
            "num_gpus_per_replica",
            f"must be None or a number >= 0, got {self.num_gpus_per_replica!r}",
        )
        need(
            self.num_ingress_replicas is None
            or (_is_int(self.num_ingress_replicas) and self.num_ingress_replicas >= 1),
            "num_ingress_replicas",
            f"must be None or an integer >= 1, got {self.num_ingress_replicas!r}",
        )
        need(
            self.max_ingress_replicas is None
            or (
                _is_int(self.max_ingress_replicas)
                and self.max_ingress_replicas >= self.ingress_replicas
            ),
            "max_ingress_replicas",
            f"must be None or an integer >= the ingress replicas ({self.ingress_replicas}), "
            f"got {self.max_ingress_replicas!r}",
        )
        need(
            _is_number(self.ingress_target_ongoing_requests)
            and self.ingress_target_ongoing_requests > 0,
            "ingress_target_ongoing_requests",
            f"must be a number > 0, got {self.ingress_target_ongoing_requests!r}",
        )
        need(
            isinstance(self.root_path, str)
            and (
                self.root_path == ""
                or (self.root_path.startswith("/") and not self.root_path.endswith("/"))
            ),
            "root_path",
            "must be empty or a path like /api (leading '/', no trailing '/'), "
            f"got {self.root_path!r}",
        )
        need(
            isinstance(self.direct_ingress, bool),
            "direct_ingress",
            f"must be true or false, got {self.direct_ingress!r}",
        )
        need(
            self.handle_transport in HANDLE_TRANSPORTS,
            "handle_transport",
            f"must be one of {', '.join(HANDLE_TRANSPORTS)}, got {self.handle_transport!r}",
        )
        need(
            isinstance(self.engine_cpu_affinity, bool),
            "engine_cpu_affinity",
            f"must be true or false, got {self.engine_cpu_affinity!r}",
        )
        need(
            isinstance(self.expose_replica_headers, bool),
            "expose_replica_headers",
            f"must be true or false, got {self.expose_replica_headers!r}",
        )
        need(
            self.log_level in LOG_LEVELS,
            "log_level",
            f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}",
        )
        need(
            self.served_model_name is None
            or (isinstance(self.served_model_name, str) and bool(self.served_model_name.strip())),
            "served_model_name",
            "must be None or a non-empty string",
        )
        need(
            isinstance(self.app_name, str)
            and self.app_name.replace("-", "").replace("_", "").isalnum(),
            "app_name",
            f"must be letters, digits, '-' or '_', got {self.app_name!r}",
        )

    @property
    def engine_cpus_to_claim(self) -> int:
        """``EngineConfig.claim_cpus`` for this cluster's engines: the whole CPUs a replica
        reserves, when ``engine_cpu_affinity``."""
        return int(self.num_cpus_per_replica) if self.engine_cpu_affinity else 0

    @property
    def ingress_replicas(self) -> int:
        """Ingress replicas to start with (the autoscaling minimum)."""
        if self.num_ingress_replicas is not None:
            return self.num_ingress_replicas
        return 2 if _is_int(self.num_replicas) and self.num_replicas > 1 else 1

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def prometheus_prefix(self) -> str:
        """``metrics_prefix`` ending in ``:`` (``vllm`` -> ``vllm:``)."""
        return self.metrics_prefix.rstrip(":") + ":"

    def replace(self, **changes) -> ClusterConfig:
        return dataclasses.replace(self, **changes)


def _section(cls, name: str, values: dict):
    if not isinstance(values, dict):
        raise ValueError(f"{name}: must be a mapping of {cls.__name__} fields, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{name}: unknown {cls.__name__} field(s) {', '.join(unknown)}")
    return cls(**values)


def configs_from_args(args: dict | None) -> tuple[EngineConfig, ClusterConfig, RouterConfig]:
    """Validated configs from the builder's args; raises ValueError naming the bad field."""
    args = dict(args or {})
    unknown = sorted(set(args) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(unknown)}; expected {', '.join(SECTIONS)}")
    engine = _section(EngineConfig, "engine", args.get("engine") or {})
    cluster = _section(ClusterConfig, "cluster", args.get("cluster") or {})
    router_values = dict(args.get("router") or {})
    block_size = router_values.setdefault("block_size", engine.block_size)
    if block_size != engine.block_size:
        raise ValueError(
            f"router.block_size ({block_size}) must equal engine.block_size ({engine.block_size})"
        )
    router = _section(RouterConfig, "router", router_values)
    return engine, cluster, router
