"""The ``prefixserve serve`` flag table: every flag's section, config field, type, help text
and help group, and the config dataclasses' defaults it reads.

One row per flag maps it onto one field of ``EngineConfig``, ``ClusterConfig`` or
``RouterConfig`` (vLLM's flag names where the meaning is the same); the defaults live only in
the dataclasses, so the help shows them without repeating them here. Pure data and lookups,
read when the parser is built: a row naming a field its dataclass lacks fails there with a
``KeyError`` (``field_default``), never at serving time.
"""

from __future__ import annotations

import dataclasses

from cluster.config import API_KEY_ENV, ClusterConfig
from router.config import RouterConfig
from worker.config import EngineConfig, parse_engine_nice

# The help's argument groups, in order; a table row names its group by key.
GROUPS = {
    "model": "model",
    "engine": "engine & KV cache",
    "parallel": "parallelism & placement",
    "http": "HTTP server",
    "lora": "LoRA adapters",
    "routing": "routing",
    "logging": "logging & metrics",
}
# The group of a row that names none (a 5-tuple), by section.
SECTION_GROUPS = {"engine": "engine", "cluster": "http", "router": "routing"}
SECTION_CLASSES = {"engine": EngineConfig, "cluster": ClusterConfig, "router": RouterConfig}
LIST = "list"
"""Row type of a comma-separated list flag (repeating the flag adds to the list)."""
MODULES = "modules"
"""Row type of ``--lora-modules``: one or more ``name=path`` or JSON ``{"name", "path"}``
values after the flag (vLLM's form; repeating the flag adds to them)."""

# (flag, section, field, type, help[, group]). type None marks a --x/--no-x boolean, LIST a
# list. Help strings never state a default: ``cli_options`` appends the dataclass field's own
# (a None default is explained in words where it means something).
FLAGS = [
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
        "--strict-json-schema", "cluster", "strict_json_schema", None,
        "JSON schemas (response_format, tool parameters) allow no property they do not list "
        "unless they say otherwise (additionalProperties); --no-strict-json-schema allows them.",
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
        "--prefill-order", "engine", "prefill_order", str,
        "Which prefill work a step serves first: shortest_first (fewest tokens left to compute; "
        "the oldest still gets half of each step) or fcfs (arrival order).",
        "engine",
    ),
    (
        "--enable-prefix-caching", "engine", "enable_prefix_caching", None,
        "Reuse KV blocks of shared prefixes.",
        "engine",
    ),
    (
        "--enforce-eager", "engine", "enforce_eager", None,
        "CUDA: run every step eagerly instead of replaying steps from CUDA graphs.",
        "engine",
    ),
    (
        "--overlap-outputs", "engine", "overlap_outputs", str,
        "on: launch each step's forward pass before building and sending the last step's "
        "outputs, hiding that host work in the device's time; off: each step's outputs leave "
        "before the next is scheduled; auto: on for CUDA and the simulated engine, off on CPU.",
        "engine",
    ),
    (
        "--async-scheduling", "engine", "async_scheduling", str,
        "on: when every sequence a step samples is greedy or drawn by temperature alone, "
        "schedule and launch the next step before its tokens reach the host (they feed it on "
        "the device); off: each step after the last one's tokens; auto: on for the simulated "
        "engine, off on CUDA; never TP.",
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
        "--kv-cache-dtype", "engine", "kv_cache_dtype", str,
        "K/V storage: auto (the model's dtype), int8 or fp8_e4m3 (8 bits with a scale per token "
        "and KV head: about twice the blocks of bfloat16 in the same bytes).",
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
        "--engine-nice", "engine", "engine_nice", parse_engine_nice,
        "Nice value the engine process asks for (default: keep), or auto: -5 when the engine "
        "leaves cores to the processes relaying its tokens (CUDA, or fewer torch threads than "
        "cores; one engine per node), so its loop goes first; below 0 it needs CAP_SYS_NICE, "
        "else it is logged and kept.",
        "engine",
    ),
    (
        "--num-threads", "engine", "num_threads", int,
        "torch intra-op threads per engine replica on CPU (default: torch's choice).",
        "engine",
    ),
    (
        "--engine", "engine", "engine", str,
        "model (run the model) or sim (the whole engine with its forward pass replaced by a "
        "timing model and pseudo-tokens: a GPU's token rate without a GPU, for load tests).",
        "engine",
    ),
    (
        "--sim-profile", "engine", "sim_profile", str,
        "With --engine sim: the timing profile, a preset (cpu, gpu) or a JSON file of one "
        "(worker/sim_profiles.json shows the fields).",
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
        "--direct-ingress", "cluster", "direct_ingress", None,
        "Each ingress replica also serves HTTP on a port of its own (Ray Serve's direct ingress, "
        "30000 and up; printed at start), skipping Serve's proxy; the proxy port still serves.",
        "http",
    ),
    (
        "--push-outputs", "cluster", "push_outputs", None,
        "Engine replicas push outputs to the ingress replica that called them, every request's "
        "of an engine step in one frame on a TCP connection to a port the ingress opens on its "
        "node; --no-push-outputs streams each output through its request's own handle call.",
        "http",
    ),
    (
        "--handle-transport", "cluster", "handle_transport", str,
        "How the ingress calls the engine replicas: grpc (Serve's gRPC channel between "
        "replicas, the cheaper per request and per streamed output) or ray (Ray actor calls). "
        "A local cluster's proxy also calls the ingress over gRPC.",
        "http",
    ),
    (
        "--engine-cpu-affinity", "cluster", "engine_cpu_affinity", None,
        "Each engine process claims CPUs of its own on its node (the simulated engine one, a "
        "CPU engine its --num-threads, within --num-cpus-per-replica; none on CUDA) while one "
        "stays unclaimed; the ingress, relays, index and hub keep off them (off by default: a "
        "claimed CPU stays the engine's while it idles).",
        "parallel",
    ),
    (
        "--support-nice", "cluster", "support_nice", int,
        "Nice steps below the engines for the processes off the request path (metrics hub, a "
        "local Ray's GCS, agents and Serve controller); 0: no change.",
        "parallel",
    ),
    # LoRA adapters
    (
        "--enable-lora", "engine", "enable_lora", None,
        "Serve LoRA adapters beside the base model: a request's model may name one, and "
        "/v1/load_lora_adapter and /v1/unload_lora_adapter change them at runtime (implied by "
        "--lora-modules).",
        "lora",
    ),
    (
        "--lora-modules", "engine", "lora_modules", MODULES,
        "Adapters served from the start, each name=path or JSON '{\"name\": ..., \"path\": "
        "...}' (a PEFT folder); requests name them in model. Put the positional MODEL first.",
        "lora",
    ),
    (
        "--max-loras", "engine", "max_loras", int,
        "Adapters on the device at once (one engine step runs at most this many distinct "
        "adapters; the rest wait in host memory).",
        "lora",
    ),
    ("--max-lora-rank", "engine", "max_lora_rank", int, "Highest adapter rank accepted.", "lora"),
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


def flag_rows() -> list[tuple]:
    """The table as 6-tuples (a row without a group gets its section's)."""
    return [row if len(row) > 5 else (*row, SECTION_GROUPS[row[1]]) for row in FLAGS]


def field_default(section: str, field: str):
    """A config field's default, read from its dataclass (the one place defaults live)."""
    for f in dataclasses.fields(SECTION_CLASSES[section]):
        if f.name == field:
            if f.default is not dataclasses.MISSING:
                return f.default
            return f.default_factory()  # type: ignore[misc]
    raise KeyError(f"{section}.{field}")
