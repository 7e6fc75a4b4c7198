"""One HTTP system's run: start its server(s), warm up, drive the workload, stop everything.

Owns ``run_http_system`` and the asyncio driver: ``bench.loadgen.client.send_request`` for every
request, ``concurrency`` in flight under a semaphore, records timed from one shared start; and
``warm_up`` (one short non-streaming request per replica before the measured run).

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

from .processes import Server
from .stats import summarize
from .systems import Run, start_servers
from .workload import ChatRequest, chat_body


def _model_name(base_url: str) -> str | None:
    import httpx

    try:
        data = httpx.get(base_url + "/v1/models", timeout=10.0).json().get("data") or []
        return data[0].get("id") if data else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


async def _run_http(
    base_url: str,
    model: str | None,
    workload: Sequence[ChatRequest],
    concurrency: int,
    max_tokens: int,
    timeout_s: float,
    label: str,
) -> tuple[list[dict], float]:
    import httpx
    from tqdm import tqdm

    from bench.loadgen.client import RequestOutput, RequestSettings, send_request

    settings = RequestSettings(
        base_url=base_url,
        model=model or "",
        endpoint="/v1/chat/completions",
        ignore_eos=True,
        timeout_s=timeout_s,
    )
    limiter = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(workload), desc=label, unit="req", file=sys.stderr)
    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4
    )
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: ChatRequest) -> dict:
            out = RequestOutput(req.index, 0)
            async with limiter:
                await send_request(
                    client, settings, chat_body(model, req.messages, max_tokens), out, t0
                )
            bar.update()
            return record_of(out, req.index)

        records = await asyncio.gather(*(one(r) for r in workload))
        duration = time.perf_counter() - t0
    bar.close()
    return list(records), duration


def record_of(out, index: int) -> dict:
    """One request's record (what ``stats.summarize`` reads) from the client's
    ``bench.loadgen.client.RequestOutput``."""
    return {
        "index": index,
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

    for i in range(n):
        body = chat_body(model, [{"role": "user", "content": f"Say hi to {i}."}], 4)
        body["stream"] = False
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
