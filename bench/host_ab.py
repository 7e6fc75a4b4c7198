"""This checkout's engine loop against another tree's, stepped in turns: host time per step.

    python -m bench.host_ab OTHER_TREE [--batch 256] [--rounds 60] [--steps-per-turn 10]
                                       [--async on] [--tag _X]

A VM's speed drifts by tens of percent over seconds (other tenants, frequency), more than
most host-path changes are worth, so two runs one after the other compare the hosts as much
as the code. Here two processes, one importing this checkout and one ``OTHER_TREE`` (a git
worktree of another commit: ``git worktree add /tmp/base HEAD~1``), each build the same
simulated engine (``bench.engine_host._sim_engine``: ``--batch`` requests past their prefill,
the ``gpu`` profile, no device wait) and take turns: ``--steps-per-turn`` steps of
``EngineLoop.step`` with its message pickled, each step's wall time kept, then the other's
turn, the order alternating every round. A round's ratio is the median step of this tree
over the other's in that round, so both saw the same stretch of the host; the report is the
median ratio over the rounds, with its quartiles. Run a tree against itself for the noise:
its median ratio is within about 2% of 1 on a 2-vCPU VM, quartiles about 4% either side.

Each process builds a fresh engine when its requests near their end (128 output tokens), not
timed. Writes ``bench/results/host_ab_cpu_<UTC date><--tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.result_files import REPO, git_commit, result_header, result_stem

TURN = """
import sys, time
from multiprocessing.reduction import ForkingPickler
from bench.engine_host import OUTPUT_TOKENS, _sim_engine
from worker.engine_core import EngineLoop
batch, ahead, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def fresh():
    engine = _sim_engine(batch, "gpu", "smollm2", wait=False, async_scheduling=ahead)
    loop = EngineLoop(engine)
    loop.overlap = True
    for _ in range(3):
        ForkingPickler.dumps(("step", loop.step()))
    return loop, 3
loop, done = fresh()
print("ready", flush=True)
for _ in sys.stdin:
    if done + steps > OUTPUT_TOKENS - 8:
        loop, done = fresh()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        ForkingPickler.dumps(("step", loop.step()))
        times.append((time.perf_counter() - start) * 1000)
    done += steps
    print(" ".join(f"{t:.4f}" for t in times), flush=True)
"""
"""One tree's side: builds its engine, then per line on stdin runs a turn and prints its
steps' wall ms."""


def start(tree: Path, batch: int, ahead: str, steps: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(
        [sys.executable, "-c", TURN, str(batch), ahead, str(steps)],
        cwd=tree,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{tree}: the engine did not start (its stderr is above)")
    return proc


def turn(proc: subprocess.Popen) -> list[float]:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return [float(x) for x in proc.stdout.readline().split()]


def compare(other: Path, batch: int, ahead: str, rounds: int, steps: int) -> dict:
    """The ratios and step times of this checkout (``this``) against ``other``."""
    procs = {"this": start(REPO, batch, ahead, steps), "other": start(other, batch, ahead, steps)}
    times: dict[str, list[float]] = {"this": [], "other": []}
    ratios = []
    try:
        for i in range(rounds):
            medians = {}
            for side in ("this", "other") if i % 2 == 0 else ("other", "this"):
                got = turn(procs[side])
                times[side] += got
                medians[side] = statistics.median(got)
            ratios.append(medians["this"] / medians["other"])
            if (i + 1) % 10 == 0:
                print(f"round {i + 1}/{rounds}: ratio so far {statistics.median(ratios):.3f}")
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "batch": batch,
        "async_scheduling": ahead,
        "rounds": rounds,
        "steps_per_turn": steps,
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_quartiles": [round(q1, 3), round(q3, 3)],
        "this_step_ms_p50": round(statistics.median(times["this"]), 3),
        "other_step_ms_p50": round(statistics.median(times["other"]), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.host_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("other", type=Path, help="the other tree (a git worktree)")
    parser.add_argument("--batch", type=int, nargs="+", default=[256])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps-per-turn", type=int, default=10)
    parser.add_argument("--async", dest="ahead", choices=["on", "off"], default="on")
    parser.add_argument("--tag", default="", help="appended to the result file's name")
    args = parser.parse_args(argv)
    other = args.other.resolve()
    if not (other / "worker" / "engine.py").exists():
        parser.error(f"{other} is not a tree of this repository")
    header = result_header("host_ab", "bench.host_ab", argv)
    other_commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=other
    ).stdout.strip()
    rows = []
    for batch in args.batch:
        row = compare(other, batch, args.ahead, args.rounds, args.steps_per_turn)
        print(
            f"batch {batch}: this/other {row['ratio_median']} "
            f"(quartiles {row['ratio_quartiles'][0]}-{row['ratio_quartiles'][1]}), "
            f"step p50 {row['this_step_ms_p50']} against {row['other_step_ms_p50']} ms"
        )
        rows.append(row)
    result = {**header, "this": git_commit(), "other": other_commit or str(other), "rows": rows}
    path = result_stem("host_ab", "cpu", args.tag).with_suffix(".json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
