"""The serving-path benchmark's report: the markdown table, the plot, the result files.

``bench/serve_path.py`` runs the systems and hands its rows here; nothing here runs a server.
"""

from __future__ import annotations

import json
from pathlib import Path

SYSTEMS = (
    "offline", "bare", "served1", "served2", "direct1", "direct2", "served1-ray", "direct1-ray"
)  # fmt: skip
"""Every system the benchmark knows, in the order tables and plots show them."""
RAY_TRANSPORT = "-ray"
"""The suffix of a served system whose ingress calls its replicas by Ray actor calls
(``--handle-transport ray``) instead of the default gRPC."""
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if not s.endswith(RAY_TRANSPORT))
"""What runs without ``--systems``: every system on the default transport."""
KINDS = ("engine", "server", "proxy", "ingress", "replica", "ray", "client")
"""Kinds of process whose CPU per streamed token a row reports."""


def _f(x, digits: int = 0) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    cols = list(KINDS)
    lines = [
        "| engine | system | c | ok/fail | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
        + " | ".join(cols)
        + " | outside engine |",
        "|---" * (8 + len(cols)) + "|",
    ]
    for r in rows:
        head = f"| {r['engine']} | {r['system']} | {r['concurrency']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:200]} |" + " |" * (5 + len(cols)))
            continue
        per = r.get("cpu_s_per_1k_tokens") or {}
        ttft = f"{_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])}" if "ttft_p50_ms" in r else ""
        itl = f"{_f(r['itl_p50_ms'], 1)} / {_f(r['itl_p99_ms'], 1)}" if "itl_p50_ms" in r else ""
        lines.append(
            f"{head} {r['completed']}/{r['failed']} | {r['output_tok_per_s']:.0f} | {ttft} | "
            f"{itl} | "
            + " | ".join(_f(per.get(k), 3) for k in cols)
            + f" | {_f(r.get('outside_engine_ms_per_token'), 3)} |"
        )
    lines.append(
        "\nCPU columns: CPU-ms per streamed output token (= CPU-s per 1k tokens) by kind of "
        "process; outside engine: every server process but the engine's; client: the load "
        "generator."
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and r.get("output_tokens")]
    colors = dict(zip(SYSTEMS, plt.get_cmap("tab10").colors, strict=False))  # one per system
    engines = list(dict.fromkeys(r["engine"] for r in rows)) or ["none"]
    fig, axes = plt.subplots(len(engines), 2, figsize=(13, 4.2 * len(engines)), squeeze=False)
    for (left, right), engine in zip(axes, engines, strict=True):
        mine = [r for r in ok if r["engine"] == engine]
        concs = sorted({r["concurrency"] for r in mine})
        systems = [s for s in SYSTEMS if any(r["system"] == s for r in mine)]
        served = [s for s in systems if s != "offline"]
        width = 0.8 / max(3, len(served))
        for s in systems:
            pts = sorted(
                (r["concurrency"], r["output_tok_per_s"]) for r in mine if r["system"] == s
            )
            xs, ys = [concs.index(x) for x, _ in pts], [y for _, y in pts]
            left.plot(xs, ys, "o-", label=s, color=colors[s])
        for j, s in enumerate(served):
            xs, ys = [], []
            for i, c in enumerate(concs):
                hit = [r for r in mine if r["system"] == s and r["concurrency"] == c]
                if hit and hit[0].get("outside_engine_ms_per_token") is not None:
                    xs.append(i + (j - (len(served) - 1) / 2) * width)
                    ys.append(hit[0]["outside_engine_ms_per_token"])
            bars = right.bar(xs, ys, width, label=s, color=colors[s])
            right.bar_label(bars, labels=[f"{y:.2g}" for y in ys], fontsize=7)
        for ax in (left, right):
            ax.set_xticks(range(len(concs)))
            ax.set_xticklabels([f"c={c}" for c in concs])
            ax.set_xlabel("requests in flight")
            if ax.has_data():
                ax.legend(fontsize=8)
        left.set_ylim(bottom=0)
        left.set_ylabel("output tokens/s")
        left.set_title(f"{engine}: throughput", fontsize=9)
        right.set_ylabel("server CPU-ms per token outside the engine")
        right.set_title(f"{engine}: CPU of the serving path", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(out_dir: Path, stem: str, header: dict, rows: list[dict]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")]
    paths[0].write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    paths[1].write_text(f"# {stem}\n\n`{header['command']}`\n\n{markdown(rows)}\n")
    plot(rows, paths[2], f"{header['cpu']}, {header['date'][:10]}: {header['title']}")
    return paths


# -- main ------------------------------------------------------------------------------------
