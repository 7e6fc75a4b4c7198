"""``bench/scale.py``'s figures: a cell's summary from its request records and ``/metrics``,
the real-against-simulated differences, and the result files (JSON, markdown tables, PNG).

Owns the arithmetic and the report, no I/O but the files ``write_report`` writes, so the tests
check them without a cluster. ``None`` stands for a figure a cell could not measure (no
successful request, a metric the server did not export): tables leave it blank.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.common import percentile


# -- the real half: summary math -----------------------------------------------------------------
def summarize_records(records: list[dict], replicas: int, duration_s: float) -> dict:
    """A cell's figures from its request records (``prompt_tokens``, ``cached_tokens``,
    ``ttft_s``, ``output_tokens``, ``replica``, ``success``): hit rate over the successful
    requests, TTFT percentiles, requests per replica (replicas that got none count as 0)."""
    ok = [r for r in records if r["success"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    ttfts = [r["ttft_s"] for r in ok]
    counts: dict[str, int] = {}
    for r in ok:
        key = r.get("replica") or "unknown"
        counts[key] = counts.get(key, 0) + 1
    loads = sorted(counts.values(), reverse=True) + [0] * max(0, replicas - len(counts))
    mean = sum(loads) / len(loads) if loads else 0.0
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"][:200] for r in records if not r["success"]})[:5],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "requests_per_replica": loads,
        "replicas_used": len([c for c in loads if c]),
        "max_mean_load": max(loads) / mean if mean else None,
        "output_tok_s": out_tokens / duration_s if duration_s > 0 else None,
        "duration_s": duration_s,
    }


def rel_diff(real: float | None, sim: float | None) -> float | None:
    """``(real - sim) / sim``; None when either is missing or ``sim`` is 0."""
    if real is None or sim is None or sim == 0:
        return None
    return (real - sim) / sim


def compare(real: dict, sim: dict) -> dict:
    return {
        f"rel_diff_{k}": rel_diff(real.get(k), sim.get(k))
        for k in ("hit_rate", "ttft_p50_s", "ttft_p90_s")
    }


def histogram_from_metrics(text: str, name: str) -> dict:
    """A Prometheus histogram's buckets (cumulative, by ``le``), sum and count from
    ``/metrics`` text, summed over label sets."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "_bucket"):
            le = head.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(value)
        elif head.startswith(name + "_sum"):
            total += float(value)
        elif head.startswith(name + "_count"):
            count += float(value)
    return {"buckets": buckets, "sum": total, "count": count}


def counter_from_metrics(text: str, name: str) -> float:
    """A Prometheus counter's value from ``/metrics`` text, summed over label sets."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == name or head.startswith(name + "{"):
            total += float(value)
    return total


def histogram_delta(after: dict, before: dict) -> dict:
    bounds = sorted(after["buckets"])
    return {
        "buckets": {b: after["buckets"][b] - before["buckets"].get(b, 0.0) for b in bounds},
        "sum": after["sum"] - before["sum"],
        "count": after["count"] - before["count"],
    }


SHARE_ABOVE_MS = 5.0
"""``histogram_summary`` says what share of the observations took longer than this (the
decision latency target's bound): how far a p99 bucket above it is from meeting it."""


SHARE_KEY = f"share_above_{SHARE_ABOVE_MS:g}_ms"


def histogram_summary(hist: dict) -> dict:
    """Mean (ms), the upper bounds (ms) of the buckets holding p50 and p99 (None when above
    the last finite bucket, ``last_bucket_ms``) and the share above ``SHARE_ABOVE_MS`` (None
    when that is not a bucket bound)."""
    n = hist["count"]
    if not n:
        return {"count": 0, "mean_ms": None, "p50_le_ms": None, "p99_le_ms": None}

    def q(frac: float):
        for bound in sorted(hist["buckets"]):
            if hist["buckets"][bound] >= frac * n:
                return None if math.isinf(bound) else 1000 * bound
        return None

    finite = [b for b in hist["buckets"] if not math.isinf(b)]
    return {
        "count": int(n),
        "mean_ms": 1000 * hist["sum"] / n,
        "p50_le_ms": q(0.5),
        "p99_le_ms": q(0.99),
        "last_bucket_ms": 1000 * max(finite) if finite else None,
        SHARE_KEY: (
            1.0 - hist["buckets"][SHARE_ABOVE_MS / 1000] / n
            if SHARE_ABOVE_MS / 1000 in hist["buckets"]
            else None
        ),
    }


def cpu_rates(before: dict, after: dict, seconds: float, kind) -> dict[str, float]:
    """CPU-s/s by kind of process between two ``Server.cpu_by_process`` snapshots."""
    by_kind: dict[str, float] = {}
    for label, t in after.items():
        used = max(0.0, t - before.get(label, 0.0))
        by_kind[kind(label)] = by_kind.get(kind(label), 0.0) + used
    return {k: round(v / seconds, 4) for k, v in sorted(by_kind.items())}


# -- the report ----------------------------------------------------------------------------------
def _f(x, spec: str = ".3f") -> str:
    return "" if x is None else format(x, spec)


def _pct(x, signed: bool = True) -> str:
    if x is None:
        return ""
    return f"{100 * x:+.0f}%" if signed else f"{100 * x:.1f}%"


def _lookup_p(lookup: dict, key: str) -> str:
    if lookup.get(key) is not None:
        return f"{lookup[key]:g}"
    if lookup.get("count") and lookup.get("last_bucket_ms") is not None:
        return f">{lookup['last_bucket_ms']:g}"
    return ""


def _pulled(row: dict, sim: dict) -> str:
    """The hit rate's pulled part, real / sim, in a cell with KV pulls ("" without)."""
    if not row.get("kv_pulls"):
        return ""
    return f" (pulled {_f(row.get('pulled_token_rate'))} / {_f(sim.get('pulled_token_rate'))})"


def _sim_preemptions(sim: dict) -> str:
    """The simulator's preemptions, or the overflow blocks an older file recorded instead."""
    if "preemptions" in sim or "overflow_blocks" not in sim:
        return _f(sim.get("preemptions"), "d")
    return f"{_f(sim['overflow_blocks'], 'd')} overflow"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| N | index | workload | policy | S | req/s | ok/fail | hit real / sim | "
        "TTFT p50 real / sim s | TTFT p90 real / sim s | TTFT p99 real / sim s | "
        "diff hit / p50 / p90 | max/mean real / sim | preemptions real / sim | "
        "startup s |",
        "|---" * 15 + "|",
    ]
    host = [
        "| N | index | workload | policy | lookup mean / p50 / p99 ms | decision mean / p50 / "
        "p99 ms | decisions > 5 ms | decision CPU mean / p50 / p99 ms | host 1 ms burst p50 / "
        "p99 ms | idle CPU-s/s per replica / all | load CPU-s/s all | send late p99 s | memory "
        "used MB |",
        "|---" * 13 + "|",
    ]
    for r in rows:
        sim = r.get("sim") or {}
        policy = f"{r['policy']} + KV pulls" if r.get("kv_pulls") else r["policy"]
        head = (
            f"| {r['replicas']} | {r['index']} | {r['workload']} | {policy} | "
            f"{r['time_scale']:.3g} | {r['rate_req_per_s']:.2f} |"
        )
        if "error" in r:
            lines.append(
                f"{head} error: {r['error'][:160]} | {_f(sim.get('hit_rate'))} sim | "
                f"{_f(sim.get('ttft_p50_s'))} sim | {_f(sim.get('ttft_p90_s'))} sim |" + " |" * 5
            )
            continue
        lk = r.get("router_lookup") or {}
        dl = r.get("router_decision") or {}
        dc = r.get("router_decision_cpu") or {}
        lines.append(
            f"{head} {r['completed']}/{r['failed']} | "
            f"{_f(r['hit_rate'])} / {_f(sim.get('hit_rate'))}{_pulled(r, sim)} | "
            f"{_f(r['ttft_p50_s'])} / {_f(sim.get('ttft_p50_s'))} | "
            f"{_f(r['ttft_p90_s'])} / {_f(sim.get('ttft_p90_s'))} | "
            f"{_f(r['ttft_p99_s'])} / {_f(sim.get('ttft_p99_s'))} | "
            f"{_pct(r.get('rel_diff_hit_rate'))} / {_pct(r.get('rel_diff_ttft_p50_s'))} / "
            f"{_pct(r.get('rel_diff_ttft_p90_s'))} | "
            f"{_f(r['max_mean_load'], '.2f')} / {_f(sim.get('max_mean_load'), '.2f')} | "
            f"{_f(r.get('preemptions'), 'd')} / {_sim_preemptions(sim)} | "
            f"{_f(r.get('startup_s'), '.0f')} |"
        )
        load = r.get("load_cpu_s_per_s") or {}
        burst = r.get("host_burst") or {}
        host.append(
            f"| {r['replicas']} | {r['index']} | {r['workload']} | {r['policy']} | "
            f"{_f(lk.get('mean_ms'), '.1f')} / {_lookup_p(lk, 'p50_le_ms')} / "
            f"{_lookup_p(lk, 'p99_le_ms')} | "
            f"{_f(dl.get('mean_ms'), '.1f')} / {_lookup_p(dl, 'p50_le_ms')} / "
            f"{_lookup_p(dl, 'p99_le_ms')} | {_pct(dl.get(SHARE_KEY), signed=False)} | "
            f"{_f(dc.get('mean_ms'), '.1f')} / {_lookup_p(dc, 'p50_le_ms')} / "
            f"{_lookup_p(dc, 'p99_le_ms')} | "
            f"{_f(burst.get('p50_ms'), '.1f')} / {_f(burst.get('p99_ms'), '.1f')} | "
            f"{_f(r.get('idle_cpu_s_per_s_per_engine_replica'), '.3f')} / "
            f"{_f(r.get('idle_cpu_s_per_s_total'), '.2f')} | "
            f"{_f(sum(load.values()) if load else None, '.2f')} | "
            f"{_f(r.get('send_lateness_p99_s'), '.2f')} | {_f(r.get('memory_used_mb'), 'd')} |"
        )
    lines += ["", *host]
    lines.append(
        "\nS: the time scale (every time of the sim profile multiplied by S); req/s: the offered "
        "rate; hit: cached prompt tokens / prompt tokens (pulled: the part whose KV came from a"
        " peer replica); preemptions: the engines' and the simulator's (in files from before "
        "the simulator modelled them, its overflow blocks: KV it let replicas hold beyond their"
        " capacity, marked 'overflow'); diff: (real - sim) / sim; lookup: the routers' index-"
        "lookup latency over the run (p50, p99: their buckets' upper bounds); decision: the "
        "routers' whole decisions (lookup, board, views, policy), the same way, and the share "
        "of them above 5 ms; decision CPU: the CPU time of each decision's thread (the decision"
        " less its waits for the GIL and for a core); host 1 ms burst: the wall time a separate"
        " process took for 1 ms of its own CPU, every 20 ms during the load (the wait for a "
        "core any timed section on this host shares); idle CPU: before the load, per engine "
        "replica (actor + engine process) and of every server process; load CPU: every server "
        "process during the load (the client not counted); send late: how late the client sent "
        "its requests against their arrival times (a saturated host); memory: the machine's, "
        "after startup."
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab10").colors
    keys = list(dict.fromkeys((r["policy"], r["index"], r["workload"]) for r in rows))
    for k, key in enumerate(keys):
        cell = sorted((r for r in rows if (r["policy"], r["index"], r["workload"]) == key),
                      key=lambda r: r["replicas"])  # fmt: skip
        label = key[0] if len(keys) == len({k[0] for k in keys}) else " / ".join(key)
        for ax, field in zip(axes, ("ttft_p90_s", "hit_rate"), strict=True):
            real = [(r["replicas"], r.get(field)) for r in cell if r.get(field) is not None]
            sim = [(r["replicas"], (r.get("sim") or {}).get(field)) for r in cell]
            sim = [p for p in sim if p[1] is not None]
            color = colors[k % len(colors)]
            if real:
                ax.plot(*zip(*real, strict=True), "o-", color=color, label=f"{label} real")
            if sim:
                ax.plot(*zip(*sim, strict=True), "s--", color=color, label=f"{label} sim")
    axes[0].set_ylabel("TTFT p90 (s)")
    axes[1].set_ylabel("hit rate (cached / prompt tokens)")
    for ax in axes:
        ax.set_xlabel("engine replicas")
        ax.set_xticks(sorted({r["replicas"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out_dir: Path, tag: str, header: dict, rows: list[dict], with_plot=True):
    """``scale_<tag>.json``, ``.md`` and (with a completed row) ``.png``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"scale_{tag}"
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    md = stem.with_suffix(".md")
    md.write_text(
        f"# Scale: {header['machine']}, {header['date']}\n\n`{header['command']}`\n\n"
        f"{header.get('note', '')}\n\n{markdown(rows)}\n"
    )
    paths = [json_path, md]
    if with_plot and any("error" not in r for r in rows):
        png = stem.with_suffix(".png")
        plot(rows, png, f"{header['machine']}, {header['date']}: real (solid) vs sim (dashed)")
        paths.append(png)
    return paths
