"""CLI of the routing simulator: every (workload, policy, replicas) in one run, JSON + PNG.

    python bench/run_sim.py                      # full run: 64/128/256 replicas, ~10 min on 2 cores
    python bench/run_sim.py --small              # a few seconds: 16 replicas, fewer requests
    python bench/run_sim.py --replicas 128 --workloads llmd_shared_prefix_73 \
        --policies prefix random
    python bench/run_sim.py --kv-pulls --tag 20261124_pulls   # replicas pull KV from peers
    python bench/run_sim.py --kv-pulls --host-capacity-blocks 512   # and a host tier each

Writes ``bench/results/sim_<date>.json`` (header: machine, date, command, rates) and
``sim_<date>_hit_rate.png`` / ``sim_<date>_ttft_p90.png``, prints a markdown table and the
verdicts on our policy (where it misses 95% of oracle, 1.2 max/mean load, lowest p90 TTFT).
Bad arguments exit with argparse's usage error; an unknown workload or policy names the choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from bench.result_files import result_header
from bench.sim import baselines, report
from bench.sim.calibration import load_pull_rates, load_rates
from bench.sim.simulator import SimConfig, Simulator
from bench.sim.workloads import WORKLOADS, WorkloadScale
from worker.config import PREFILL_ORDERS, EngineConfig

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _ours(args):
    from bench.sim.ours import OursPolicy  # imported late: a broken router fails only 'prefix'

    overrides = {}
    if args.max_load_ratio is not None:
        overrides["max_load_ratio"] = None if args.max_load_ratio <= 0 else args.max_load_ratio
    if args.miss_cost_factor is not None:
        overrides["miss_cost_factor"] = args.miss_cost_factor
    return OursPolicy(
        speculative=not args.no_speculative,
        router_overrides=overrides,
        pull_price_factor=args.pull_price_factor,
    )


POLICIES = {
    "random": lambda a: baselines.RandomPolicy(),
    "round_robin": lambda a: baselines.RoundRobinPolicy(),
    "least_loaded": lambda a: baselines.LeastLoadedPolicy(),
    "pow2": lambda a: baselines.PowerOfTwoPolicy(),
    "sglang_cache_aware": lambda a: baselines.SGLangCacheAwarePolicy(),
    "llmd_precise": lambda a: baselines.LlmdPrecisePolicy(),
    "prefix": _ours,
}


def _pull_price_factor(args) -> float:
    from bench.sim.ours import PULL_PRICE_FACTOR

    return PULL_PRICE_FACTOR if args.pull_price_factor is None else args.pull_price_factor


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    p.add_argument("--capacity-blocks", type=int, default=512, help="device KV blocks per replica")
    p.add_argument(
        "--host-capacity-blocks", type=int, default=0, help="host tier per replica (0: off)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--requests-per-replica", type=int, default=30)
    p.add_argument(
        "--offered-load",
        type=float,
        default=1.0,
        help="arrival rate / cluster prefill capacity without cache hits",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-speculative",
        action="store_true",
        help="ours without speculative index entries (KV events only)",
    )
    p.add_argument(
        "--kv-pulls",
        action="store_true",
        help="replicas pull missing prefixes from peers at calibration.json's kv_pull rate "
        "(every policy; prefix prices the pulls)",
    )
    p.add_argument(
        "--max-load-ratio",
        type=float,
        default=None,
        help="prefix's RouterConfig.max_load_ratio (default: RouterConfig's; <= 0: no bound)",
    )
    p.add_argument("--miss-cost-factor", type=float, default=None, help="prefix's miss_cost_factor")
    p.add_argument(
        "--pull-price-factor",
        type=float,
        default=None,
        help="with --kv-pulls: prefix prices a pull at this many times its transfer time "
        "(default: bench/sim/ours.py PULL_PRICE_FACTOR)",
    )
    p.add_argument(
        "--prefill-order",
        choices=PREFILL_ORDERS,
        default=EngineConfig.prefill_order,
        help="the replicas' engine prefill order (EngineConfig.prefill_order)",
    )
    p.add_argument("--small", action="store_true", help="16 replicas, 20 requests each")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default=None, help="file name suffix (default: the UTC date)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.small:
        args.replicas, args.requests_per_replica = [16], 20
    return args


def run(args) -> tuple[list[dict], dict]:
    rates = load_rates()
    pull = load_pull_rates() if args.kv_pulls else None
    if args.kv_pulls and pull is None:
        raise SystemExit("--kv-pulls: bench/results/calibration.json has no 'kv_pull' section")
    rows = []
    total = sum(n * args.requests_per_replica for n in args.replicas)
    total *= len(args.workloads) * len(args.policies)
    with tqdm(total=total, unit="req", desc="simulating", file=sys.stderr) as bar:
        for n in args.replicas:
            scale = WorkloadScale(
                num_replicas=n,
                capacity_blocks=args.capacity_blocks,
                block_size=args.block_size,
                requests_per_replica=args.requests_per_replica,
                offered_load=args.offered_load,
                prefill_tokens_per_s=rates.prefill_tokens_per_s,
                seed=args.seed,
            )
            for workload_name in args.workloads:
                workload = WORKLOADS[workload_name](scale)
                for policy_name in args.policies:
                    bar.set_postfix_str(f"{n} x {workload_name} / {policy_name}")
                    config = SimConfig(
                        n,
                        args.capacity_blocks,
                        args.block_size,
                        args.host_capacity_blocks,
                        rates,
                        args.seed,
                        pull,
                        args.prefill_order,
                    )
                    result = Simulator(config, POLICIES[policy_name](args)).run(
                        workload, bar.update
                    )
                    row = dataclasses.asdict(result)
                    row["workload_description"] = workload.description
                    rows.append(row)
    header = {
        **result_header("sim", "bench/run_sim.py", sys.argv[1:]),
        "rates": dataclasses.asdict(rates),
        "capacity_blocks": args.capacity_blocks,
        "host_capacity_blocks": args.host_capacity_blocks,
        "block_size": args.block_size,
        "requests_per_replica": args.requests_per_replica,
        "offered_load": args.offered_load,
        "seed": args.seed,
        "prefill_order": args.prefill_order,
        "speculative": not args.no_speculative,
        "kv_pull": None if pull is None else dataclasses.asdict(pull),
        "prefix_pull_price_factor": None if pull is None else _pull_price_factor(args),
        "prefix_overrides": {
            "max_load_ratio": args.max_load_ratio,
            "miss_cost_factor": args.miss_cost_factor,
        },
    }
    return rows, header


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    rows, header = run(args)
    header["wall_s"] = round(time.perf_counter() - started, 1)
    tag = args.tag or time.strftime("%Y%m%d", time.gmtime())
    lines = report.verdicts(rows)
    header["verdicts_on_ours"] = lines
    summary = report.ours_summary(rows)
    header["ours_summary"] = summary
    path = report.write_results(rows, header, args.out_dir / f"sim_{tag}.json")
    print(report.markdown_table(rows))
    if not args.no_plots:
        subtitle = report.plot_subtitle(header)
        for png in report.plot_results(rows, args.out_dir / f"sim_{tag}", subtitle):
            print(f"wrote {png}")
    print(f"wrote {path} in {header['wall_s']} s")
    print("\n" + report.summary_table(summary))
    print("\nWhere ours misses the bars (95% of oracle hit rate, max/mean <= 1.2, lowest p90):")
    print("\n".join(f"- {line}" for line in lines) if lines else "- nowhere")
    return 0


if __name__ == "__main__":
    sys.exit(main())
