"""One HTTP system's run: start its server(s), warm up, drive the workload, stop everything.

Owns ``run_http_system`` (the workload through ``bench.loadgen.client.run_benchmark``:
``concurrency`` in flight, chat, greedy, ``ignore_eos``; each request's ``RequestOutput``
turned into the record ``stats.summarize`` reads), ``warm_up`` (one short non-streaming
request per replica before the measured run) and the CPU accounting of the server processes
(``cpu_breakdown``, ``measure_idle``).

Failure modes: any exception while starting, warming up or loading becomes the row's
``error`` (the other systems still run) and the servers are stopped in ``finally``; a request
that fails is a failed record, counted in the row. ``warm_up`` retries 429/503 for
``patience_s`` (a server may answer /health before it can route) and raises on anything else.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence

from bench.loadgen.client import (
    RequestOutput,
    RequestSettings,
    first_model,
    request_body,
    run_benchmark,
)
from bench.loadgen.workloads import ChatRequest

from .processes import Server
from .stats import summarize
from .systems import Run, start_servers


def _model_name(base_url: str) -> str | None:
    """The server's first model, or None when it lists none (the body then names no model)."""
    import httpx

    try:
        return first_model(base_url)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def _settings(base_url: str, model: str | None, timeout_s: float = 300.0) -> RequestSettings:
    return RequestSettings(
        base_url, model or "", "/v1/chat/completions", ignore_eos=True, timeout_s=timeout_s
    )


async def _run_http(
    base_url: str,
    model: str | None,
    workload: Sequence[ChatRequest],
    concurrency: int,
    max_tokens: int,
    timeout_s: float,
    label: str,
) -> tuple[list[dict], float]:
    from tqdm import tqdm

    bar = tqdm(total=len(workload), desc=label, unit="req", file=sys.stderr)
    outputs, stats = await run_benchmark(
        _settings(base_url, model, timeout_s),
        [r.conversation(max_tokens) for r in workload],
        max_concurrency=concurrency,
        on_done=lambda _: bar.update(),
    )
    bar.close()
    return [record_of(o) for o in outputs], stats.duration_s


def record_of(out: RequestOutput) -> dict:
    """One request's record (what ``stats.summarize`` reads) from the client's
    ``RequestOutput``; ``index`` is its conversation's (the request's index)."""
    return {
        "index": out.conversation_id,
        "success": out.success,
        "error": out.error,
        "prompt_tokens": out.prompt_len,
        "output_tokens": out.output_tokens,
        "cached_tokens": out.cached_tokens,
        "ttft_s": out.ttft_s,
        "itl_s": out.itl_s,
        "latency_s": out.latency_s,
        "text": out.generated_text,
        "replica": out.replica,
    }


def warm_up(base_url: str, model: str | None, n: int = 1, patience_s: float = 120.0) -> None:
    """``n`` short chat requests (distinct, so a router may spread them); raises on failure.

    A 503/429 is retried for ``patience_s``: a server may answer /health before it can route.
    """
    import httpx

    settings = _settings(base_url, model)
    for i in range(n):
        messages = [{"role": "user", "content": f"Say hi to {i}."}]
        body = {**request_body(settings, 4, messages=messages), "stream": False}
        body.pop("stream_options")
        deadline = time.monotonic() + patience_s
        while True:
            r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300.0)
            if r.status_code == 200:
                break
            if r.status_code not in (429, 503) or time.monotonic() > deadline:
                raise RuntimeError(f"warm-up request failed: HTTP {r.status_code}: {r.text[:300]}")
            time.sleep(2.0)


def _cpu_used(before: list[dict], after: list[dict]) -> list[tuple[str, float]]:
    """(kind of process, CPU seconds) between two ``Server.cpu_by_process`` snapshots (one
    per server), largest first; a process started in between counts from zero, one that ended
    in between is left out (its time is in the tree's total only)."""
    used: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for label, cpu_s in a.items():
            used[label] = used.get(label, 0.0) + cpu_s - b.get(label, 0.0)
    return sorted(used.items(), key=lambda kv: -kv[1])


def cpu_breakdown(before: list[dict], after: list[dict]) -> dict[str, float]:
    """``_cpu_used`` rounded to 0.1 s, those under 0.05 s left out."""
    return {k: round(v, 1) for k, v in _cpu_used(before, after) if v >= 0.05}


def measure_idle(servers: Sequence[Server], idle_s: float) -> dict:
    """What the servers' processes use with no request in flight, over ``idle_s`` seconds:
    ``idle_cpu_s`` (all of them) and ``idle_cpu_s_by_process``, both per second of idling.

    A served run's processes share the cores with the engine, so this floor (a Ray cluster's
    controller, GCS, raylet and agents; the deployments' metrics and heartbeats) is paid by
    every run whatever the serving path does."""
    before = [s.cpu_by_process() for s in servers]
    t0 = time.monotonic()
    time.sleep(idle_s)
    elapsed_s = time.monotonic() - t0
    per_s = [
        (k, v / elapsed_s) for k, v in _cpu_used(before, [s.cpu_by_process() for s in servers])
    ]
    return {
        "idle_s": round(elapsed_s, 1),
        "idle_cpu_s": round(sum(v for _, v in per_s if v > 0), 3),
        "idle_cpu_s_by_process": {k: round(v, 3) for k, v in per_s if v >= 0.0005},
    }


def run_http_system(run: Run, args, workload: Sequence[ChatRequest]) -> dict:
    tag = f"{args.stamp}_{run.system}_c{run.concurrency}"
    servers: list[Server] = []
    row: dict = {}
    try:
        t0 = time.monotonic()
        base, ready = start_servers(run, args, tag, servers)
        ready()
        row["startup_s"] = round(time.monotonic() - t0, 1)
        row["command"] = " | ".join(s.command for s in servers)
        model = _model_name(base)
        warm_up(base, model, run.replicas)
        if args.idle_s > 0:
            row.update(measure_idle(servers, args.idle_s))
        cpu0 = sum(s.cpu_seconds() for s in servers)
        by_process0 = [s.cpu_by_process() for s in servers]
        records, duration = asyncio.run(
            _run_http(
                base,
                model,
                workload,
                run.concurrency,
                args.max_tokens,
                args.request_timeout_s,
                f"{run.system} c={run.concurrency}",
            )
        )
        cpu1 = sum(s.cpu_seconds() for s in servers)
        row.update(summarize(records, duration))
        row["cpu_s"] = round(cpu1 - cpu0, 1)
        row["cpu_s_by_process"] = cpu_breakdown(by_process0, [s.cpu_by_process() for s in servers])
        replicas = sorted({r["replica"] for r in records if r.get("replica")})
        if replicas:
            row["replica_request_counts"] = {
                x: sum(r.get("replica") == x for r in records) for x in replicas
            }
    except Exception as exc:  # a system that fails is recorded, the others still run
        row["error"] = f"{type(exc).__name__}: {exc}"
        row.setdefault("command", " | ".join(s.command for s in servers))
    finally:
        for s in reversed(servers):
            s.stop()
    return row
