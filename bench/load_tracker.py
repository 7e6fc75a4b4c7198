"""What the load tracker costs a routing decision as the tracked requests grow.

Every decision of the request router calls ``LoadTracker.loads`` (each replica's load from its
stats, this router's tracked requests and its peers'), and the in-flight board's publisher
calls ``LoadTracker.snapshot`` after changes. This drives one tracker the way a router under
load does, on ``--replicas`` replicas with ``N`` requests of its own in flight and ``N`` of
its peers', for each ``N`` of ``--in-flight``: per decision one event (a decision, its
confirmation; every third a first output; once ``N`` are in flight, a completion), a new stats
report in twenty decisions, new peer rows every ten, then ``loads``; a ``snapshot`` every ten
(each timed apart; the stats and rows are made untimed); the tracker's clock advances 50 ms
per decision, 20 decisions a second. CPU time of this thread, the best of
``--repeats`` rounds. Writes ``bench/results/load_tracker.json`` and a PNG beside it.

    python -m bench.load_tracker [--replicas 32] [--in-flight 30,300,1000]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from bench.result_files import git_commit, machine_name
from router.load import LoadSnapshot, LoadTracker, TrackedRequest
from router.protocol import ReplicaStats

RESULTS = Path(__file__).parent / "results" / "load_tracker.json"
DECISION_GAP_S = 0.05
"""The tracker's clock between two decisions (20 a second): what completions its stats may
still show and which decisions they caught up with follow from it."""
STATS_EVERY = 20
"""Decisions between two stats reports (each replica's once a second)."""
PEERS_EVERY = 10
"""Decisions between two syncs of the peers' rows."""


def measure(num_replicas: int, in_flight: int, decisions: int, seed: int) -> dict:
    """CPU-ms per decision (event + ``loads``) and per ``snapshot``, ``in_flight`` own and
    peer requests on ``num_replicas`` replicas."""
    rng = random.Random(seed)
    replicas = [f"replica-{i}" for i in range(num_replicas)]
    clock = [1_000_000.0]
    tracker = LoadTracker(clock=lambda: clock[0])
    keys: list[tuple[str, str]] = []

    def stats() -> dict[str, ReplicaStats]:
        as_of_s = clock[0] - 0.5
        return {r: ReplicaStats(num_waiting=2, num_running=6, as_of_s=as_of_s) for r in replicas}

    def peers() -> LoadSnapshot:
        now_s = clock[0]
        rows: dict[str, list[TrackedRequest]] = {r: [] for r in replicas}
        for _ in range(in_flight):
            first = None if rng.random() < 0.3 else now_s - 1.0
            rows[rng.choice(replicas)].append(TrackedRequest(now_s - 3 * rng.random(), 100, first))
        return LoadSnapshot({r: tuple(sorted(v)) for r, v in rows.items()})

    def decide(i: int) -> None:
        key, replica = f"k{i}", rng.choice(replicas)
        tracker.decided(key, replica, 100)
        tracker.routed(key, replica)
        if i % 3 == 0:
            tracker.first_output(key)
        keys.append((key, replica))
        if len(keys) > in_flight:
            tracker.completed(*keys.pop(0))

    for i in range(in_flight):  # fill, untimed
        clock[0] += DECISION_GAP_S
        decide(i)
    current_stats, current_peers = stats(), peers()
    decision_cpu_s = snapshot_cpu_s = 0.0
    for n in range(decisions):
        i = in_flight + n
        clock[0] += DECISION_GAP_S
        if n % STATS_EVERY == 0:  # made untimed
            current_stats = stats()
        if n % PEERS_EVERY == 0:
            current_peers = peers()
        start_cpu_s = time.thread_time()
        decide(i)
        tracker.loads(current_stats, current_peers)
        decision_cpu_s += time.thread_time() - start_cpu_s
        if n % PEERS_EVERY == 0:
            start_cpu_s = time.thread_time()
            tracker.snapshot()
            snapshot_cpu_s += time.thread_time() - start_cpu_s
    per_decision_ms = 1000 * decision_cpu_s / decisions
    per_snapshot_ms = 1000 * snapshot_cpu_s / (decisions // PEERS_EVERY)
    return {"decision_cpu_ms": per_decision_ms, "snapshot_cpu_ms": per_snapshot_ms}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    n = [r["in_flight"] for r in rows]
    ax.plot(n, [r["decision_cpu_ms"] for r in rows], "o-", label="event + loads (a decision)")
    ax.plot(n, [r["snapshot_cpu_ms"] for r in rows], "s--", label="snapshot (the board)")
    ax.set_xlabel("requests in flight (own; as many peers')")
    ax.set_ylabel("CPU-ms")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--in-flight", default="30,300,1000", help="own (and peer) requests")
    ap.add_argument("--decisions", type=int, default=2000, help="timed decisions per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the best is kept")
    ap.add_argument("--out", type=Path, default=RESULTS)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.in_flight.split(",")):
        rounds = [measure(args.replicas, n, args.decisions, seed) for seed in range(args.repeats)]
        row = {
            "replicas": args.replicas,
            "in_flight": n,
            "decision_cpu_ms": round(min(r["decision_cpu_ms"] for r in rounds), 4),
            "snapshot_cpu_ms": round(min(r["snapshot_cpu_ms"] for r in rounds), 4),
        }
        print(
            f"{n:5d} in flight (and as many peers'): event + loads {row['decision_cpu_ms']:.3f} "
            f"CPU-ms, snapshot {row['snapshot_cpu_ms']:.3f} CPU-ms",
            flush=True,
        )
        rows.append(row)
    result = {
        "benchmark": "load_tracker",
        "machine": machine_name(),
        "git_commit": git_commit(),
        "command": " ".join(["python -m bench.load_tracker", *argv]),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    plot(rows, png, f"The load tracker at {args.replicas} replicas, {result['machine']}")
    print(f"wrote {args.out}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
