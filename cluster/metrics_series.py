"""The exported series: names (vLLM's, without the prefix), help texts and buckets, the
default prefix, and which process counts which series (docs/metrics.md maps each to vLLM's).

Plain constants and ``token_buckets``, shared by the snapshots (``cluster/metrics_snapshots.py``)
and the rendering (``cluster/metrics_render.py``); nothing here can fail at serving time. A
series added here must be fed by a snapshot and rendered, or it is exported as zero.
"""

from __future__ import annotations

PREFIX = "prefixserve:"
"""The default series-name prefix (``ClusterConfig.metrics_prefix``); ``vllm:`` makes vLLM's
dashboards and autoscaling rules read ours unchanged."""

# vLLM's buckets, so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# vLLM uses its e2e buckets for every per-request phase (queue, prefill, decode, inference).
REQUEST_PHASE_BUCKETS_S = E2E_BUCKETS_S


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            bound = mantissa * scale
            if bound > max_model_len:
                return tuple(float(b) for b in bounds)
            bounds.append(bound)
        scale *= 10


GAUGES = {
    "num_requests_running": "Requests holding KV blocks in the engine.",
    "num_requests_waiting": "Requests waiting for admission.",
    "kv_cache_usage_perc": "Fraction of KV blocks in use, in [0, 1].",
}
COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "prompt_tokens": "Prompt tokens processed.",
    "generation_tokens": "Tokens generated.",
    "num_preemptions": "Requests preempted for lack of KV blocks.",
    "host_cache_hits": "Prompt tokens of prefix-cache hits served from the host KV tier.",
    "kv_offload_bytes": "KV bytes copied from the device tier to the host tier.",
    "kv_onload_bytes": "KV bytes copied from the host tier back to the device tier.",
}
HISTOGRAMS = {
    "engine_time_to_first_token_seconds": (
        "Time from the engine's arrival of a request to its first token.",
        TTFT_BUCKETS_S,
    ),
    "inter_token_latency_seconds": ("Time between successive output steps.", ITL_BUCKETS_S),
    "engine_e2e_request_latency_seconds": (
        "Time from the engine's arrival of a request to its finish.",
        E2E_BUCKETS_S,
    ),
    "engine_queue_time_seconds": (
        "Time a request waited in the engine before its first scheduling.",
        REQUEST_PHASE_BUCKETS_S,
    ),
    "request_prefill_time_seconds": (
        "Time from a request's first scheduling to its first token.",
        REQUEST_PHASE_BUCKETS_S,
    ),
    "request_decode_time_seconds": (
        "Time from a request's first token to its finish.",
        REQUEST_PHASE_BUCKETS_S,
    ),
    "request_inference_time_seconds": (
        "Time from a request's first scheduling to its finish.",
        REQUEST_PHASE_BUCKETS_S,
    ),
    "kv_pull_seconds": (
        "Time of each KV pull from a peer replica, the order to the import or the failure.",
        TTFT_BUCKETS_S,
    ),
}
REPLICA_COUNTERS = {
    "kv_pulls": "KV pulls from a peer replica, ordered by the router (cluster/kv_pull.py).",
    "kv_pull_failures": "KV pulls that failed or timed out; their requests prefilled instead.",
    "kv_pull_blocks": "KV blocks imported from peer replicas.",
    "kv_pull_tokens": "Prompt tokens whose KV came from peer replicas.",
    "kv_pull_bytes": "KV bytes received from peer replicas.",
}
"""Counted by the replica itself (``ReplicaMetrics.count``), not by the engine."""
INFO_GAUGES = {
    "cache_config_info": (
        "The replica's KV cache configuration in its labels; the value is always 1.",
        ("block_size", "kv_cache_dtype"),
    ),
    "lora_requests_info": (
        "Running stats on LoRA requests: the adapters with running and with waiting requests "
        "(comma-separated) and the device slots (max_lora), in its labels; the value is "
        "always 1. Only replicas serving LoRA adapters have it.",
        ("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
    ),
}
"""vLLM's ``*_info`` gauges: a replica's static configuration as labels (beside
``model_name`` and ``replica``) of a series whose value is 1. Each snapshot carries its own
label values (``ReplicaMetrics.snapshot``'s ``info``); a replica that sends none (an older
version) has no series."""
INGRESS_HISTOGRAMS = {
    "time_to_first_token_seconds": (
        "Time from the ingress receiving a request to its first output there.",
        TTFT_BUCKETS_S,
    ),
    "e2e_request_latency_seconds": (
        "Time from the ingress receiving a request to its last output there.",
        E2E_BUCKETS_S,
    ),
    "request_queue_time_seconds": (
        "Time from the ingress receiving a request to the start of its prefill "
        "(tokenization, routing, Serve's queue, the engine's queue).",
        REQUEST_PHASE_BUCKETS_S,
    ),
}
TOKEN_HISTOGRAMS = {
    "request_prompt_tokens": "Prompt tokens of each finished engine request.",
    "request_generation_tokens": "Generated tokens of each finished choice.",
}
FINISHED_REASONS = ("stop", "length", "abort", "error")
"""``request_success_total``'s ``finished_reason`` values: vLLM's, and ``error`` for a choice
cut short by a failure (``abort``: the client left or the cluster drained)."""
