"""Real-cluster comparison of routing policies in one run: prefix vs round robin vs least loaded.

    python bench/serve_compare.py                     # 3 CPU replicas, bundled SmolLM2
    python bench/serve_compare.py --replicas 2 --policies prefix round_robin \\
        --launch "prefixserve serve --num-replicas {replicas} --routing {policy} --port {port} \\
        --expose-replica-headers"

For each policy it starts the cluster with ``--launch`` (``{replicas}``, ``{policy}``,
``{port}`` filled in; the port is a free one derived per run), waits for ``GET /health`` to
answer 200, runs the load generator (``bench.loadgen``) with the *same* workload, seed and
rate, then stops the cluster it started (SIGINT, then SIGTERM after a grace period). It
writes ``bench/results/serve_compare_<date>.json`` (header: machine, date, command, load
average; one row per policy with the ``vllm bench serve`` summary keys, cached-token ratio,
per-replica counts, their max/mean and the load average around its run),
``serve_compare_<date>.md`` (the table) and ``serve_compare_<date>.png``. Each replica's
torch runs ``--threads-per-replica`` threads (``OMP_NUM_THREADS`` in the server's
environment, which Ray's workers inherit), so replicas do not oversubscribe a small machine.

Failure modes: a cluster that is not healthy within ``--startup-timeout-s`` is stopped and
its policy recorded with an ``error``; the other policies still run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.loadgen import cli as loadgen_cli
from bench.sim.report import machine_name

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_LAUNCH = (
    "prefixserve serve --num-replicas {replicas} --routing {policy} --port {port} "
    "--expose-replica-headers"
)
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
    "mean_e2el_ms",
    "cached_token_ratio",
    "replica_request_counts",
)
STOP_GRACE_S = 30.0  # Serve and Ray need a few seconds to drain and shut down cleanly


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it was healthy")
        try:
            if httpx.get(base_url + "/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    raise RuntimeError(f"server not healthy within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(timeout=STOP_GRACE_S)


def run_policy(args, policy: str, loadgen_argv: list[str]) -> dict:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = args.launch.format(replicas=args.replicas, policy=policy, port=port)
    log_path = args.log_dir / f"serve_compare_{args.tag}_{policy}.log"
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(args.threads_per_replica)
    # The launched CLI imports this checkout's packages, installed or not.
    repo_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    load_before = os.getloadavg()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_healthy(base_url, proc, args.startup_timeout_s)
            ns = loadgen_cli.build_parser().parse_args(
                ["--base-url", base_url, "--label", policy, "--disable-tqdm", *loadgen_argv]
            )
            result = loadgen_cli.run(ns)
        except RuntimeError as exc:
            return {"policy": policy, "command": command, "error": str(exc)}
        finally:
            load_after = os.getloadavg()
            _stop(proc)
    row = {"policy": policy, "command": command}
    row.update({k: result.get(k) for k in SUMMARY_KEYS})
    counts = list((row.get("replica_request_counts") or {}).values())
    if counts and len(counts) < args.replicas:
        counts += [0] * (args.replicas - len(counts))  # a replica that got nothing
    row["max_mean_load"] = max(counts) / (sum(counts) / len(counts)) if sum(counts) else None
    row["loadavg_before"] = [round(x, 2) for x in load_before]
    row["loadavg_after"] = [round(x, 2) for x in load_after]
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| policy | ok | p50 TTFT ms | p90 TTFT ms | p99 TTFT ms | cached | per replica | "
        "max/mean | load avg (1 min) before/after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['policy']} | error: {r['error']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['policy']} | {r['completed']}/{r['completed'] + r['failed']} | "
            f"{r['median_ttft_ms']:.0f} | {r['p90_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
            f"{(r['cached_token_ratio'] or 0):.3f} | {r['replica_request_counts']} | "
            f"{r['max_mean_load'] or 0:.2f} | "
            f"{r['loadavg_before'][0]:.2f} / {r['loadavg_after'][0]:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    names = [r["policy"] for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    # TTFT: one group of bars per policy (p50, p90, p99), seconds.
    pcts = (("median_ttft_ms", "p50"), ("p90_ttft_ms", "p90"), ("p99_ttft_ms", "p99"))
    width = 0.8 / len(pcts)
    for j, (key, label) in enumerate(pcts):
        xs = [i + (j - 1) * width for i in range(len(ok))]
        axes[0].bar(xs, [r[key] / 1000 for r in ok], width, label=label)
    axes[0].set_title("time to first token, s (lower is better)")
    axes[0].legend()
    axes[1].bar(names, [r["cached_token_ratio"] or 0 for r in ok], color="#2b7bba")
    axes[1].set_ylim(0, 1)
    axes[1].set_title("cached share of prompt tokens (higher is better)")
    # Requests per replica: replicas are numbered within each policy's own cluster.
    most = max((len(r["replica_request_counts"]) for r in ok), default=0)
    width = 0.8 / max(most, 1)
    for j in range(most):
        xs = [i + (j - (most - 1) / 2) * width for i in range(len(ok))]
        counts = [sorted(r["replica_request_counts"].values(), reverse=True) for r in ok]
        axes[2].bar(
            xs, [c[j] if j < len(c) else 0 for c in counts], width, label=f"replica {j + 1}"
        )
    axes[2].set_title("requests per replica (busiest first)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(range(len(ok)))
        ax.set_xticklabels(names)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["prefix", "round_robin", "least_loaded"])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--launch", default=DEFAULT_LAUNCH)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default=time.strftime("%Y%m%d", time.gmtime()))
    p.add_argument("--threads-per-replica", type=int, default=1)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="server logs (not results)")
    p.add_argument(
        "loadgen_args",
        nargs="*",
        default=[
            "--dataset-name",
            "generated-shared-prefix",
            "--gsp-num-groups",
            "6",
            "--gsp-prompts-per-group",
            "8",
            "--gsp-system-prompt-len",
            "384",
            "--gsp-question-len",
            "32",
            "--gsp-output-len",
            "16",
            "--request-rate",
            "2",
            "--seed",
            "0",
            "--metric-percentiles",
            "50,90,99",
        ],
        help="flags passed to the load generator after '--' (same for every policy)",
    )
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    loadgen_argv = list(args.loadgen_args)
    if "--metric-percentiles" not in loadgen_argv:
        loadgen_argv += ["--metric-percentiles", "50,90,99"]
    load_start = os.getloadavg()
    rows = [run_policy(args, policy, loadgen_argv) for policy in args.policies]
    header = {
        "machine": machine_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python "
        + shlex.join(["bench/serve_compare.py", *(sys.argv[1:] if argv is None else argv)]),
        "replicas": args.replicas,
        "threads_per_replica": args.threads_per_replica,
        "loadgen_args": loadgen_argv,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "note": "shared 2-core machine: other work ran alongside (see the load averages)",
    }
    path = args.out_dir / f"serve_compare_{args.tag}.json"
    path.write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    table = markdown(rows)
    (args.out_dir / f"serve_compare_{args.tag}.md").write_text(
        f"# Real run: {header['date']}, {header['machine']}\n\n`{header['command']}`\n\n"
        f"{args.replicas} CPU replicas, {args.threads_per_replica} thread(s) each; load average "
        f"at start {header['loadavg_start']}, at end {header['loadavg_end']}.\n\n{table}\n"
    )
    print(table)
    if any("error" not in r for r in rows):
        subtitle = (
            f"{header['machine']} {header['date']}, {args.replicas} replicas x "
            f"{args.threads_per_replica} thread, load avg {header['loadavg_start'][0]:.1f}"
        )
        plot(rows, args.out_dir / f"serve_compare_{args.tag}.png", subtitle)
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
