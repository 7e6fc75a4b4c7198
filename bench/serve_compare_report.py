"""The report of ``bench/serve_compare.py``: verdicts, medians over repeated runs, tables, plot.

Owns what turns the benchmark's rows (one per workload, cluster size, policy and run) into a
judgement: ``verdict`` (does prefix beat every rival on output tok/s and each TTFT percentile,
and serve >= ``ORACLE_BAR`` of the oracle's cached tokens), ``summarize`` (one row per cell:
the median of its runs), ``markdown``/``runs_markdown`` (the tables) and ``plot`` (grouped
bars, min-max whiskers over runs). No I/O but the PNG ``plot`` writes; rows that carry an
``error`` are reported as such and never win.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

OURS = "prefix"
ORACLE_BAR = 0.9  # the bar: prefix serves >= 90% of the oracle's cached tokens

# Figures the verdict compares: (result key, label, True when higher is better).
FIGURES = (
    ("output_throughput", "tok/s", True),
    ("median_ttft_ms", "p50", False),
    ("p90_ttft_ms", "p90", False),
    ("p99_ttft_ms", "p99", False),
)


def busy_fractions(requests: Sequence[dict]) -> dict[str, float]:
    """Replica -> the share of the run (first request's start to last request's end) during
    which it had at least one of ``requests`` (``replica``, ``start_s``, ``latency_s``) open.
    On a machine whose cores the replicas share, a policy that leaves one idle gives the others
    its core: this is how to see it."""
    spans = [(r["start_s"], r["start_s"] + r["latency_s"], r["replica"]) for r in requests]
    if not spans:
        return {}
    run_s = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
    by_replica: dict[str, list[tuple[float, float]]] = {}
    for start, end, replica in spans:
        by_replica.setdefault(replica, []).append((start, end))
    busy: dict[str, float] = {}
    for replica, intervals in by_replica.items():
        covered_s, reach_s = 0.0, float("-inf")  # reach: where the covered time ends so far
        for start, end in sorted(intervals):
            covered_s += max(0.0, end - max(start, reach_s))
            reach_s = max(reach_s, end)
        busy[replica] = round(covered_s / run_s, 3) if run_s > 0 else 1.0
    return busy


def arrivals_during_prefill(requests: Sequence[dict]) -> dict | None:
    """How many of ``requests`` (``replica``, ``start_s``, ``ttft_s``) arrived while another
    request on their replica had not produced its first token yet (queued or prefilling), and
    the median TTFT (ms) of those and of the rest; None without requests. At a few requests
    per replica this, more than the count on the replica, sets a warm request's TTFT: it
    shares its first steps with that prefill."""
    if not requests:
        return None
    met, clear = [], []
    for r in requests:
        others = (o for o in requests if o is not r and o["replica"] == r["replica"])
        busy = any(o["start_s"] <= r["start_s"] < o["start_s"] + o["ttft_s"] for o in others)
        (met if busy else clear).append(r["ttft_s"] * 1000.0)
    return {
        "share": round(len(met) / len(requests), 3),
        "ttft_ms_met": round(statistics.median(met), 1) if met else None,
        "ttft_ms_clear": round(statistics.median(clear), 1) if clear else None,
    }


def table_name(row: dict) -> str:
    """The table a row belongs to: its workload, and its KV dtype when not the model's."""
    kv = row.get("kv_cache_dtype") or "auto"
    return row["workload"] if kv == "auto" else f"{row['workload']}, KV {kv}"


def verdict(rows: Sequence[dict]) -> dict:
    """For one (workload, size): does prefix beat every other policy on each figure, and does it
    serve >= ``ORACLE_BAR`` of the oracle's cached tokens? ``passed`` is all of them."""
    ours = next((r for r in rows if r["policy"] == OURS and "error" not in r), None)
    others = [r for r in rows if r["policy"] != OURS and "error" not in r]
    if ours is None or not others:
        return {"passed": False, "figures": {}, "oracle": None, "note": "prefix or rivals missing"}
    figures = {}
    for key, label, higher in FIGURES:
        mine = ours[key]
        figures[label] = all((mine > r[key]) if higher else (mine < r[key]) for r in others)
    share = ours.get("served_of_oracle")
    oracle_ok = None if share is None else share >= ORACLE_BAR
    passed = all(figures.values()) and oracle_ok is not False and not ours["failed"]
    return {"passed": passed, "figures": figures, "oracle": oracle_ok}


# Figures a summary row takes the median of, over a (workload, size, policy)'s runs.
MEDIAN_KEYS = (
    "output_throughput",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "mean_tpot_ms",
    "duration",
    "cached_token_ratio",
    "total_cached_tokens",
    "served_of_oracle",
    "max_mean_load",
)


def summarize(rows: Sequence[dict]) -> list[dict]:
    """One row per (workload, size, policy): its run's row when it ran once, else the median of
    every ``MEDIAN_KEYS`` figure over the runs that did not error, with ``runs`` (how many),
    ``ranges`` (figure -> [min, max]) and ``failed`` summed. Errored runs are left out; a cell
    whose runs all errored keeps the first error row."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((table_name(r), r["replicas"], r["policy"]), []).append(r)
    out = []
    for runs in cells.values():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            out.append(runs[0])
            continue
        if len(runs) == 1:
            out.append({**ok[0], "runs": 1})
            continue
        summary = {k: v for k, v in ok[0].items() if k not in ("requests", "cache", "repeat")}
        summary["runs"] = len(ok)
        summary["failed"] = sum(r["failed"] or 0 for r in ok)
        summary["completed"] = sum(r["completed"] or 0 for r in ok)
        summary["ranges"] = {}
        for key in MEDIAN_KEYS:
            values = [r[key] for r in ok if r.get(key) is not None]
            if values:
                summary[key] = statistics.median(values)
                summary["ranges"][key] = [min(values), max(values)]
        placements = [(r.get("cache") or {}).get("placement_cached_tokens") for r in ok]
        placements = [p for p in placements if p is not None]
        if placements:
            summary["cache"] = {"placement_cached_tokens": statistics.median(placements)}
        summary["replica_request_counts"] = None  # differs by run: the runs table has them
        out.append(summary)
    return out


def groups(rows: Sequence[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault((table_name(r), r["replicas"]), []).append(r)
    return out


def _verdict_cell(row: dict, v: dict) -> str:
    if row["policy"] != OURS:
        return ""
    beaten = [label for label, ok in v["figures"].items() if ok]
    lost = [label for label, ok in v["figures"].items() if not ok]
    text = "beats all on " + (", ".join(beaten) or "nothing")
    if lost:
        text += "; not on " + ", ".join(lost)
    if v["oracle"] is not None:
        text += f"; oracle {'>=' if v['oracle'] else '<'} {ORACLE_BAR:.0%}"
    return ("PASS: " if v["passed"] else "FAIL: ") + text


def markdown(rows: Sequence[dict]) -> str:
    """One table per workload (and KV dtype): a row per (size, policy) with the verdict on
    prefix's row."""
    out = []
    for workload in dict.fromkeys(table_name(r) for r in rows):
        out += [
            f"### {workload}",
            "",
            "| replicas | policy | ok | out tok/s | TTFT p50 / p90 / p99 ms | cached ratio | "
            "cached tok | placement tok | oracle tok | served/oracle | per replica | "
            "max/mean | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for (name, size), group in groups(rows).items():
            if name != workload:
                continue
            v = verdict(group)
            for r in group:
                if "error" in r:
                    out.append(f"| {size} | {r['policy']} | error: {r['error']} |" + " |" * 10)
                    continue
                oracle = r.get("oracle_cached_tokens")
                share = r.get("served_of_oracle")
                placement = (r.get("cache") or {}).get("placement_cached_tokens", "n/a")
                out.append(
                    f"| {size} | {r['policy']} | {r['completed']}/{r['completed'] + r['failed']} "
                    f"| {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} / "
                    f"{r['p90_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                    f"{(r['cached_token_ratio'] or 0):.3f} | {r['total_cached_tokens']} | "
                    f"{placement} | {'n/a' if oracle is None else oracle} | "
                    f"{'n/a' if share is None else f'{share:.1%}'} | "
                    f"{_per_replica(r)} | "
                    f"{r['max_mean_load'] or 0:.2f} | {_verdict_cell(r, v)} |"
                )
        out.append("")
    return "\n".join(out)


def kv_dtype_markdown(rows: Sequence[dict]) -> str:
    """Each (workload, size, policy) across KV dtypes: blocks per replica, served/oracle,
    TTFT p50/p90 and tok/s side by side; empty when the rows have one KV dtype."""
    dtypes = list(dict.fromkeys(r.get("kv_cache_dtype") or "auto" for r in rows))
    if len(dtypes) < 2:
        return ""
    out = [
        "| workload | replicas | policy | KV dtype | KV blocks per replica | served/oracle | "
        "TTFT p50 / p90 ms | out tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ok = [r for r in rows if "error" not in r]
    keys = dict.fromkeys((r["workload"], r["replicas"], r["policy"]) for r in ok)
    for workload, size, policy in keys:
        for r in ok:
            if (r["workload"], r["replicas"], r["policy"]) != (workload, size, policy):
                continue
            share = r.get("served_of_oracle")
            out.append(
                f"| {workload} | {size} | {policy} | {r.get('kv_cache_dtype') or 'auto'} | "
                f"{r.get('kv_blocks_per_replica', 'n/a')} | "
                f"{'n/a' if share is None else f'{share:.1%}'} | "
                f"{r['median_ttft_ms']:.0f} / {r['p90_ttft_ms']:.0f} | "
                f"{r['output_throughput']:.1f} |"
            )
    return "\n".join(out) + "\n"


def _per_replica(row: dict) -> str:
    counts = row.get("replica_request_counts")
    if counts is None and row.get("runs", 1) > 1:
        return f"{row['runs']} runs"
    return " ".join(str(c) for c in (counts or {}).values())


def runs_markdown(rows: Sequence[dict]) -> str:
    """Every run's figures, in the order they ran (the median table's sources)."""
    out = [
        "| workload | replicas | policy | run | out tok/s | TTFT p50 / p90 / p99 ms | "
        "served/oracle | per replica | busy | arrived during a prefill (TTFT p50 ms then / "
        "else) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {table_name(r)} | {r['replicas']} | {r['policy']} | {r.get('repeat', 1)} |"
        if "error" in r:
            out.append(f"{head} error: {r['error']} | | | | | |")
            continue
        share = r.get("served_of_oracle")
        out.append(
            f"{head} {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} / "
            f"{r['p90_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
            f"{'n/a' if share is None else f'{share:.1%}'} | {_per_replica(r)} | "
            f"{' '.join(f'{b:.2f}' for b in (r.get('replica_busy_fraction') or {}).values())} | "
            f"{_during_prefill(r.get('arrivals_during_prefill'))} |"
        )
    return "\n".join(out) + "\n"


def _during_prefill(arrivals: dict | None) -> str:
    if not arrivals:
        return "n/a"
    met, clear = arrivals["ttft_ms_met"], arrivals["ttft_ms_clear"]
    return (
        f"{arrivals['share']:.0%} ({'-' if met is None else f'{met:.0f}'} / "
        f"{'-' if clear is None else f'{clear:.0f}'})"
    )


def plot(rows: Sequence[dict], path: Path, subtitle: str) -> None:
    """Grouped bars: one row of panels per workload (tok/s, TTFT p50/p90/p99, served/oracle),
    cluster sizes on the x axis, one bar per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    names = list(dict.fromkeys(table_name(r) for r in ok))
    policies = list(dict.fromkeys(r["policy"] for r in ok))
    panels = (
        ("output_throughput", "output tok/s (higher is better)", 1.0),
        ("median_ttft_ms", "TTFT p50, s (lower is better)", 1e-3),
        ("p90_ttft_ms", "TTFT p90, s", 1e-3),
        ("p99_ttft_ms", "TTFT p99, s", 1e-3),
        ("served_of_oracle", "cached tokens / oracle's", 1.0),
    )
    fig, axes = plt.subplots(len(names), len(panels), figsize=(18, 3.6 * len(names)), squeeze=False)
    colors = {"prefix": "#d95f02", "round_robin": "#7570b3", "least_loaded": "#1b9e77"}
    for i, name in enumerate(names):
        sizes = sorted({r["replicas"] for r in ok if table_name(r) == name})
        width = 0.8 / max(len(policies), 1)
        for j, (key, title, scale) in enumerate(panels):
            ax = axes[i][j]
            for k, policy in enumerate(policies):
                cell = {
                    r["replicas"]: r for r in ok if table_name(r) == name and r["policy"] == policy
                }
                xs = [s + (k - (len(policies) - 1) / 2) * width for s in range(len(sizes))]
                ys = [(cell[s].get(key) or 0) * scale if s in cell else 0 for s in sizes]
                spans = [(cell.get(s) or {}).get("ranges", {}).get(key) for s in sizes]
                yerr = None
                if any(spans):  # the runs' min-max around the median
                    yerr = [
                        [y - (sp[0] * scale if sp else y) for y, sp in zip(ys, spans, strict=True)],
                        [(sp[1] * scale if sp else y) - y for y, sp in zip(ys, spans, strict=True)],
                    ]
                ax.bar(xs, ys, width, label=policy, color=colors.get(policy), yerr=yerr, capsize=3)
            if key == "served_of_oracle":
                ax.axhline(ORACLE_BAR, color="k", lw=0.8, ls="--")
                ax.set_ylim(0, 1.05)
            ax.set_xticks(range(len(sizes)))
            ax.set_xticklabels([f"{s} replicas" for s in sizes])
            ax.set_title(f"{name}: {title}", fontsize=9)
        axes[i][0].legend(fontsize=8)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
