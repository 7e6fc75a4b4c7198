"""Simulator results: the JSON file (header + one row per run), the PNG plots, the verdicts.

The JSON is ``{"header": {...}, "rows": [...]}``; the header is
``bench.result_files.result_header``'s (machine, date, command, git commit) with the cost rates
used and the run's sizes; every row holds at least ``workload``, ``policy``,
``replicas``, ``hit_rate``, ``oracle_hit_rate``, ``ttft_p50_s``, ``ttft_p90_s``, ``ttft_p99_s``,
``throughput_tok_s`` and ``max_mean_load`` (our policy's rows say ``policy: "prefix"``), and
newer files ``pooled_hit_rate`` (the oracle with the cluster's capacity: one LRU cache of all
the replicas' blocks), which tells a workload that does not fit from routing that loses hits,
and ``copied_block_share`` (how much of the stored device blocks are copies of each other).
``verdicts`` states, per (workload, replicas), where ours misses the issue's bars: 95% of the
oracle hit rate, max/mean load 1.2, the lowest p90 TTFT. Plotting uses matplotlib's Agg
backend (no display needed); a missing matplotlib raises ``ImportError`` at plot time only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

OURS = "prefix"
HIT_RATE_BAR = 0.95  # ours must reach 95% of the oracle's hit rate
LOAD_BAR = 1.2  # ours must keep max/mean replica load at most 1.2
P90_TIE_REL = 0.01  # p90 TTFTs within 1% are a tie (often the same prefill time), not a loss


def write_results(rows: Sequence[dict], header: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header, "rows": list(rows)}, indent=1) + "\n")
    return path


def verdicts(rows: Sequence[dict]) -> list[str]:
    """One line per (workload, replicas) where ours misses a bar; empty when it meets them all."""
    lines = []
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["replicas"]), []).append(row)
    for (workload, replicas), group in sorted(groups.items()):
        ours = next((r for r in group if r["policy"] == OURS), None)
        if ours is None:
            continue
        where = f"{workload} @ {replicas} replicas"
        ratio = ours["hit_rate"] / ours["oracle_hit_rate"] if ours["oracle_hit_rate"] else 1.0
        if ratio < HIT_RATE_BAR:
            lines.append(f"{where}: hit rate {ours['hit_rate']:.3f} is {ratio:.1%} of oracle")
        if ours["max_mean_load"] > LOAD_BAR:
            lines.append(f"{where}: max/mean load {ours['max_mean_load']:.2f} > {LOAD_BAR}")
        best = min(group, key=lambda r: r["ttft_p90_s"])
        if best["policy"] != OURS and best["ttft_p90_s"] * (1 + P90_TIE_REL) < ours["ttft_p90_s"]:
            lines.append(
                f"{where}: p90 TTFT {ours['ttft_p90_s']:.3f}s, {best['policy']} has "
                f"{best['ttft_p90_s']:.3f}s"
            )
    return lines


def ours_summary(rows: Sequence[dict]) -> list[dict]:
    """Per (workload, replicas): ours' hit rate as a fraction of the oracle's, its max/mean
    load, and its p90 TTFT rank among the policies run (1 + those beating it by more than
    ``P90_TIE_REL``, so a tie with the best is rank 1)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["replicas"]), []).append(row)
    summary = []
    for (workload, replicas), group in sorted(groups.items()):
        ours = next((r for r in group if r["policy"] == OURS), None)
        if ours is None:
            continue
        oracle = ours["oracle_hit_rate"]
        summary.append(
            {
                "workload": workload,
                "replicas": replicas,
                "hit_of_oracle": ours["hit_rate"] / oracle if oracle else 1.0,
                "hit_of_pooled": _of(ours["hit_rate"], ours.get("pooled_hit_rate")),
                "max_mean_load": ours["max_mean_load"],
                "copied_block_share": ours.get("copied_block_share"),
                "p90_rank": 1
                + sum(r["ttft_p90_s"] * (1 + P90_TIE_REL) < ours["ttft_p90_s"] for r in group),
                "num_policies": len(group),
            }
        )
    return summary


def _of(hit_rate: float, reference: float | None) -> float | None:
    """``hit_rate`` as a fraction of ``reference`` (None without one: older result files)."""
    if reference is None:
        return None
    return hit_rate / reference if reference else 1.0


def summary_table(summary: Sequence[dict]) -> str:
    lines = [
        "| workload | replicas | hit % of oracle | hit % of pooled LRU | copies | max/mean "
        "| p90 rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        pooled, copied = s.get("hit_of_pooled"), s.get("copied_block_share")
        lines.append(
            f"| {s['workload']} | {s['replicas']} | {s['hit_of_oracle']:.1%} | "
            f"{'-' if pooled is None else f'{pooled:.1%}'} | "
            f"{'-' if copied is None else f'{copied:.1%}'} | "
            f"{s['max_mean_load']:.2f} | {s['p90_rank']} of {s['num_policies']} |"
        )
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict]) -> str:
    head = (
        "| workload | replicas | policy | hit | oracle | pooled LRU | p50 s | p90 s | p99 s "
        "| tok/s | max/mean |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        pooled = r.get("pooled_hit_rate")
        lines.append(
            f"| {r['workload']} | {r['replicas']} | {r['policy']} | {r['hit_rate']:.3f} | "
            f"{r['oracle_hit_rate']:.3f} | {'-' if pooled is None else f'{pooled:.3f}'} | "
            f"{r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | "
            f"{r['ttft_p99_s']:.2f} | {r['throughput_tok_s']:.0f} | {r['max_mean_load']:.2f} |"
        )
    return "\n".join(lines)


def _grouped_bars(ax, rows, workload: str, metric: str, policies, replica_counts) -> None:
    width = 0.8 / max(len(replica_counts), 1)
    for k, n in enumerate(replica_counts):
        values = []
        for policy in policies:
            row = next(
                (
                    r
                    for r in rows
                    if (r["workload"], r["policy"], r["replicas"]) == (workload, policy, n)
                ),
                None,
            )
            values.append(row[metric] if row else float("nan"))
        xs = [i + (k - (len(replica_counts) - 1) / 2) * width for i in range(len(policies))]
        bars = ax.bar(xs, values, width, label=f"{n} replicas")
        for bar, policy in zip(bars, policies, strict=True):
            if policy == OURS:
                bar.set_edgecolor("black")
                bar.set_linewidth(1.5)
    ax.set_xticks(range(len(policies)))
    ax.set_xticklabels(policies, rotation=30, ha="right", fontsize=8)
    ax.set_title(workload, fontsize=10)


def plot_subtitle(header: dict) -> str:
    """The plots' second line: machine, date, the replicas' KV tiers, pulls and the rates."""
    tiers = f"{header['capacity_blocks']} device"
    if header.get("host_capacity_blocks"):
        tiers += f" + {header['host_capacity_blocks']} host"
    pulls = "KV pulls on" if header.get("kv_pull") else "no KV pulls"
    return (
        f"{header['machine']}, {header['date']}, {tiers} blocks per replica, {pulls}\n"
        f"rates: {header['rates']['source']}"
    )


def plot_results(rows: Sequence[dict], out_prefix: Path, subtitle: str) -> list[Path]:
    """Two PNGs: hit rate against the oracle, and p90 TTFT, per policy and workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    replica_counts = sorted({r["replicas"] for r in rows})
    paths = []
    for metric, title, fname in (
        (
            "hit_rate",
            "Cached-token hit rate (dashed: oracle, one infinite cache; dotted: one LRU cache "
            "of the whole cluster's capacity, where lower)",
            "hit_rate",
        ),
        ("ttft_p90_s", "p90 time to first token, seconds (log scale, lower is better)", "ttft_p90"),
    ):
        num_cols = min(3, len(workloads))
        num_rows = -(-len(workloads) // num_cols)
        fig, axes = plt.subplots(
            num_rows, num_cols, figsize=(5.2 * num_cols, 4.2 * num_rows), squeeze=False
        )
        flat = [ax for row in axes for ax in row]
        for ax in flat[len(workloads) :]:
            ax.set_visible(False)
        for ax, workload in zip(flat, workloads, strict=False):
            _grouped_bars(ax, rows, workload, metric, policies, replica_counts)
            if metric == "hit_rate":
                oracle = max(r["oracle_hit_rate"] for r in rows if r["workload"] == workload)
                ax.axhline(oracle, color="black", linestyle="--", linewidth=1)
                pooled = [r.get("pooled_hit_rate") for r in rows if r["workload"] == workload]
                if None not in pooled and min(pooled) < oracle - 0.001:  # the workload overflows
                    ax.axhline(min(pooled), color="black", linestyle=":", linewidth=1)
                ax.set_ylim(0, 1)
            else:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
                ax.tick_params(axis="y", which="minor", labelsize=7)
        flat[0].legend(fontsize=8)
        fig.suptitle(f"{title}\n{subtitle} (ours: 'prefix', outlined)", fontsize=11)
        fig.tight_layout()
        path = Path(f"{out_prefix}_{fname}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
