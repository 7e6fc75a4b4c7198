"""Results: the markdown table, the two-panel plot, and the JSON + PNG files.

Owns ``markdown`` (one line per row; a failed row shows its error), ``plot`` (output tok/s and
TTFT p50 per concurrency, one bar per system; rows with an error are left out) and
``write_results`` (``<out_dir>/<stem>.json`` and ``.png``; the header is
``bench.result_files.result_header``'s with the run's own keys).

Failure modes: ``write_results`` creates ``out_dir`` and lets ``OSError`` from writing it
through.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def _fmt(x, digits=0) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def markdown(rows: Sequence[dict]) -> str:
    lines = [
        "| system | c | reqs | ok/fail | out tok/s | req/s | TTFT p50 / p90 / p99 ms | ITL ms "
        "| TPOT ms "
        "| cached | CPU s | idle CPU s/s | = offline | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['label']} | {r['concurrency']} | {r['num_requests']} |"
        if "error" in r:
            lines.append(f"{head} | | | | | | | | | | error: {r['error'][:160]} |")
            continue
        same = r.get("same_as_offline")
        lines.append(
            f"{head} {r['completed']}/{r['failed']} | {r['output_tok_per_s']:.1f} | "
            f"{r['request_per_s']:.2f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['itl_mean_ms']:.1f} | "
            f"{r['tpot_mean_ms']:.1f} | {_fmt(r.get('cached_token_ratio'), 3) or 'n/a'} | "
            f"{_fmt(r.get('cpu_s'), 0)} | {_fmt(r.get('idle_cpu_s'), 3)} | "
            f"{'' if same is None else f'{same:.0%}'} | {'; '.join(r.get('errors') or [])[:120]} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and r.get("completed")]
    concs = sorted({r["concurrency"] for r in ok})
    labels = list(dict.fromkeys(r["label"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(labels))
    for ax, key, ylabel in (
        (axes[0], "output_tok_per_s", "output tokens/s (higher is better)"),
        (axes[1], "ttft_p50_ms", "TTFT p50, ms (lower is better)"),
    ):
        for j, label in enumerate(labels):
            xs, ys = [], []
            for i, c in enumerate(concs):
                hit = [r for r in ok if r["label"] == label and r["concurrency"] == c]
                if hit:
                    xs.append(i + (j - (len(labels) - 1) / 2) * width)
                    ys.append(hit[0][key])
            bars = ax.bar(xs, ys, width, label=label)
            ax.bar_label(bars, labels=[f"{y:.3g}" for y in ys], fontsize=7)
        ax.set_xticks(range(len(concs)))
        ax.set_xticklabels([f"c={c}" for c in concs])
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(ylabel)
    if ok:
        axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(
    out_dir: Path, stem: str, header: dict, rows: Sequence[dict]
) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps({"header": header, "rows": list(rows)}, indent=1) + "\n")
    plot(
        rows,
        png_path,
        f"{header.get('cpu', '')}, {header.get('date', '')[:10]}: {header.get('title', '')}",
    )
    return json_path, png_path
