"""The simulator as it runs now, beside the real cells of ``bench.scale`` result files.

    python -m bench.scale_resimulate bench/results/scale_2026-11-27_mirror8.json ... --tag DATE

For each file (one ``python -m bench.scale`` command in its header; merged files of several
commands are skipped, as are rows with an error), each real cell is simulated again with that
command's workload, size, rates and policy (``bench.scale.plan_cell`` and ``simulate``, no
cluster starts) and put beside the real figures and the simulator's figures as the file
recorded them: hit rate, TTFT p50 and p90, and ``(real - sim) / sim`` then and now. So a
change to the simulator is checked against every real run already made.

Writes ``<out-dir>/scale_resimulated_<tag>.json`` (header and rows) and ``.md`` (the table,
also printed). Fails with the JSON or key error of a file that is not a ``bench.scale``
result.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from bench import scale
from bench.result_files import RESULTS, result_header
from bench.scale_report import rel_diff


def resimulate(paths: list[Path], out_dir: Path, tag: str) -> list[Path]:
    """Each real cell of the result files at ``paths`` beside the simulator as the file ran
    it and as it runs now (same workload, size, rates and policy, from the file's command):
    ``scale_resimulated_<tag>.json`` and ``.md``. Rows with an error are skipped."""
    rows = []
    for path in paths:
        result = json.loads(path.read_text())
        command = shlex.split(result["header"]["command"])
        if command[:3] != ["python", "-m", "bench.scale"] or ";" in result["header"]["command"]:
            scale._progress(f"{path}: not one bench.scale command, skipped")
            continue
        argv = command[3:]
        args = scale.parse_args([*argv, "--no-real"])
        base_profile = scale.load_base_profile(args.sim_profile)
        for row in result["rows"]:
            if "error" in row:
                continue
            plan = scale.plan_cell(args, base_profile, row["replicas"], row["workload"])
            real = {k: row[k] for k in ("hit_rate", "ttft_p50_s", "ttft_p90_s")}
            rows.append(
                {
                    "file": path.name,
                    "replicas": row["replicas"],
                    "policy": row["policy"],
                    "index": row["index"],
                    "workload": row["workload"],
                    "real": real,
                    "sim_then": {k: row["sim"][k] for k in real},
                    "sim_now": {
                        k: v
                        for k, v in scale.simulate(args, plan, row["policy"]).items()
                        if k in real
                    },
                }
            )
    header = result_header("scale_resimulated", "bench.scale_resimulate")
    lines = [
        f"# The simulator against the real cells, {time.strftime('%Y-%m-%d', time.gmtime())}",
        "",
        "`(real - sim) / sim` with the simulator as each file ran it and as it runs now "
        f"(`{header['command']}`, commit {header['git_commit']}).",
        "",
        "| file | replicas | policy | index | hit rate real / then / now | TTFT p50 real / then / "
        "now (s) | TTFT p90 real / then / now (s) | hit diff then -> now | p50 diff then -> now | "
        "p90 diff then -> now |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def diff(real: dict, sim: dict, key: str) -> str:
        d = rel_diff(real[key], sim[key])
        return "-" if d is None else f"{d:+.0%}"

    for r in rows:
        real, then, now = r["real"], r["sim_then"], r["sim_now"]
        lines.append(
            f"| {r['file']} | {r['replicas']} | {r['policy']} | {r['index']} | "
            f"{real['hit_rate']:.3f} / {then['hit_rate']:.3f} / {now['hit_rate']:.3f} | "
            f"{real['ttft_p50_s']:.2f} / {then['ttft_p50_s']:.2f} / {now['ttft_p50_s']:.2f} | "
            f"{real['ttft_p90_s']:.2f} / {then['ttft_p90_s']:.2f} / {now['ttft_p90_s']:.2f} | "
            f"{diff(real, then, 'hit_rate')} -> {diff(real, now, 'hit_rate')} | "
            f"{diff(real, then, 'ttft_p50_s')} -> {diff(real, now, 'ttft_p50_s')} | "
            f"{diff(real, then, 'ttft_p90_s')} -> {diff(real, now, 'ttft_p90_s')} |"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"scale_resimulated_{tag}"
    stem.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return [stem.with_suffix(".json"), stem.with_suffix(".md")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.scale_resimulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="+", type=Path, metavar="RESULT_JSON")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--tag", default=None, help="file name suffix (default: the UTC date)")
    args = p.parse_args(argv)
    resimulate(args.files, args.out_dir, args.tag or time.strftime("%Y-%m-%d", time.gmtime()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
