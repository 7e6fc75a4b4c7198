"""Per-row metrics from per-request records, and the check against the offline engine's text.

Owns ``summarize`` (one
row: throughputs over the wall time, TTFT percentiles, ITL/TPOT means, cached-token ratio over
the requests that reported it, short digests of each greedy text) and ``same_as_offline``.

Failure modes: none raised for empty or failed runs; those give zeros, ``None`` ratios and an
``errors`` list (the first 5 distinct messages). A record missing a required key is a
``KeyError``: a bug in the driver that built it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from bench.common import percentile


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def summarize(records: Sequence[dict], duration_s: float) -> dict:
    """One row's metrics from per-request records.

    A record: ``success``, ``error``, ``prompt_tokens``, ``output_tokens``, ``cached_tokens``
    (None when not reported), ``ttft_s``, ``itl_s`` (gaps between streamed chunks),
    ``latency_s``, ``text``. Throughputs divide by ``duration_s`` (first send to last finish).
    """
    ok = [r for r in records if r["success"]]
    dur = duration_s if duration_s > 0 else 1e-9
    out_tokens = sum(r["output_tokens"] for r in ok)
    ttfts = [r["ttft_s"] for r in ok]
    itls = [g for r in ok for g in r["itl_s"]]
    tpots = [
        (r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
        for r in ok
        if r["output_tokens"] > 1
    ]
    reported = [r for r in ok if r.get("cached_tokens") is not None]
    reported_prompt = sum(r["prompt_tokens"] for r in reported)
    errors = sorted({r["error"] for r in records if not r["success"]})
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": round(duration_s, 3),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "output_tokens": out_tokens,
        "output_tok_per_s": round(out_tokens / dur, 2),
        "request_per_s": round(len(ok) / dur, 3),
        "ttft_mean_ms": round(1000 * sum(ttfts) / len(ttfts), 1) if ttfts else 0.0,
        "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
        "ttft_p90_ms": round(1000 * percentile(ttfts, 90), 1),
        "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
        "itl_mean_ms": round(1000 * sum(itls) / len(itls), 2) if itls else 0.0,
        "tpot_mean_ms": round(1000 * sum(tpots) / len(tpots), 2) if tpots else 0.0,
        "cached_token_ratio": (
            round(sum(r["cached_tokens"] for r in reported) / reported_prompt, 4)
            if reported_prompt
            else None
        ),
        "errors": errors[:5],
        "text_digests": [_digest(r.get("text", "")) if r["success"] else None for r in records],
    }


def same_as_offline(rows: list[dict]) -> None:
    """Each row's share of requests whose greedy text equals the offline engine's (same c)."""
    offline = {
        r["concurrency"]: r.get("text_digests")
        for r in rows
        if r["system"] == "offline" and "error" not in r
    }
    for r in rows:
        ref = offline.get(r["concurrency"])
        if ref and "error" not in r and r["system"] != "offline":
            pairs = [(a, b) for a, b in zip(r["text_digests"], ref, strict=False) if a and b]
            r["same_as_offline"] = (
                round(sum(a == b for a, b in pairs) / len(pairs), 3) if pairs else None
            )
