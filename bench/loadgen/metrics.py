"""Benchmark metrics with ``vllm bench serve``'s printed labels and JSON keys, plus ours.

Same definitions as vLLM: TTFT is the time to the first streamed text; TPOT is
``(latency - ttft) / (output_tokens - 1)`` per request; ITL is every gap between streamed
chunks; E2EL is the request's latency; throughputs divide by the benchmark's duration;
``max_output_tokens_per_s`` is the busiest one-second bucket. Times in the JSON's ``*_ms``
keys are milliseconds; the ``ttfts``/``itls`` lists are seconds, as vLLM writes them.
Additions: ``cached_token_ratio`` (sum of ``usage.prompt_tokens_details.cached_tokens`` over
prompt tokens, ``None`` when the server never reported it) and ``replica_request_counts``
(from the ``x-prefixserve-replica`` header; empty when the server does not send it).
Failure modes: with no successful request every latency statistic is 0, as in vLLM.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence

from bench.common import percentile
from bench.loadgen.client import RequestOutput, RunStats

METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _stats_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    ms = [v * 1000.0 for v in values_s]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def compute_result(
    outputs: Sequence[RequestOutput], stats: RunStats, percentiles: Sequence[float] = (99,)
) -> dict:
    ok = [o for o in outputs if o.success]
    duration_s = stats.duration_s or 1e-9
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    buckets = collections.Counter(int(t) for o in ok for t in o.token_times_s)
    tpots = [(o.latency_s - o.ttft_s) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    reported = [o for o in ok if o.cached_tokens is not None]
    reported_prompt = sum(o.prompt_len for o in reported)
    result = {
        "duration": stats.duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": max(buckets.values(), default=0),
        "max_concurrent_requests": stats.max_concurrent_requests,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft_s for o in outputs],
        "itls": [o.itl_s for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "total_cached_tokens": sum(o.cached_tokens for o in reported),
        "cached_token_ratio": (
            sum(o.cached_tokens for o in reported) / reported_prompt if reported_prompt else None
        ),
        "replica_request_counts": dict(
            sorted(collections.Counter(o.replica for o in ok if o.replica).items())
        ),
    }
    series = {
        "ttft": [o.ttft_s for o in ok],
        "tpot": tpots,
        "itl": [gap for o in ok for gap in o.itl_s],
        "e2el": [o.latency_s for o in ok],
    }
    for name, _, _ in METRICS:
        result.update(_stats_ms(name, series[name], percentiles))
    return result


def format_result(result: dict, percentiles: Sequence[float], request_rate, max_concurrency) -> str:
    """The text ``vllm bench serve`` prints, plus our cache and replica lines."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="<10"):
        lines.append("{:<40} {:{fmt}}".format(label, value, fmt=fmt))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Request rate configured (RPS):", f"{request_rate:.2f}")
    row("Benchmark duration (s):", result["duration"], "<10.2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], "<10.2f")
    row("Output token throughput (tok/s):", result["output_throughput"], "<10.2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], "<10.2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"], "<10.2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], "<10.2f")
    for name, short, title in METRICS:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], "<10.2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], "<10.2f")
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", result[f"p{p:g}_{name}_ms"], "<10.2f")
    lines.append("{s:{c}^{n}}".format(s="Prefix cache and replicas", n=50, c="-"))
    ratio = result["cached_token_ratio"]
    row("Cached-token ratio:", "n/a" if ratio is None else f"{ratio:.4f}")
    for replica, count in result["replica_request_counts"].items():
        row(f"Requests on {replica}:", count)
    lines.append("=" * 50)
    return "\n".join(lines)
