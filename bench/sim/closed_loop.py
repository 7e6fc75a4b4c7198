"""Closed-loop replay: the real routing policies on a step-level model of engine replicas.

    python -m bench.sim.closed_loop --policies prefix round_robin least_loaded --tag NAME

What ``bench/sim/simulator.py`` (open loop, one prefill server per replica) leaves out and
``bench/serve_compare.py``'s workloads depend on: clients that send their next request when
the last one finished (a closed loop at ``concurrency``), and steps that mix every running
request's decode token with the queued prefills, so a cold prefill lengthens the step that
every other request on its replica waits for. Owns ``ClosedLoopConfig``, ``replay`` and its
``Outcome``.

The policies (``router.policies``) decide on views built as the request router builds them:
each replica's stats, refreshed once per ``stats_period_s``, merged by ``router.load`` with a
``LoadTracker`` told each decision, first output and completion; and matches as the index
serves them: the replicas that stored a system prompt, plus those a decision sent it to
(the router's speculative entries) until they store it.

A replica runs back-to-back steps. A step computes one token of every running request and
the queued prefills, first come first served, up to ``budget_tokens`` (a request that is
first in the step goes whole); it costs ``step_base_s + step_per_running_s * running +
prefill tokens / prefill_tokens_per_s``. A queued request whose system prompt another request
in the step computes waits for it and then hits (the engine's in-flight dedup). A request's
first output comes at the end of the step that prefilled it; its client sends the next
request ``return_s`` after its last token. Every request decodes ``output_tokens``
(``max_tokens`` with ``ignore_eos``). Caches never evict: ``equal_caches`` starts every
replica holding every system prompt; otherwise a replica holds one once it has prefilled it.

The CLI replays each policy over ``--seeds`` seeds per run length and writes the medians to
``bench/results/closed_loop_<tag>.json``, ``.md`` and ``.png``. Deterministic for a seed;
raises ``ValueError`` on a config it cannot run.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench.common import percentile
from bench.result_files import result_header
from router.config import RouterConfig
from router.index_types import Match
from router.load import LoadTracker
from router.policies import make_policy
from router.policy import ReplicaView, RoutingPolicy
from router.protocol import ReplicaStats, hash_blocks

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
NEVER_FULL_BLOCKS = 1 << 20
"""The empty blocks a replica reports: caches never evict here."""


@dataclass(frozen=True)
class ClosedLoopConfig:
    """A workload and the engine's cost model. The defaults are ``bench/serve_compare.py``'s
    ``engine`` workload (4 system prompts in turn, 64 tokens out, concurrency 8) on 2
    replicas, costed like SmolLM2 on one core of an AVX-512 CPU (a warm request's TTFT about
    0.3 s, a cold prompt's prefill about 0.8 s, a decode step at 4 running about 0.1 s)."""

    num_replicas: int = 2
    concurrency: int = 8
    num_requests: int = 64
    output_tokens: int = 64
    num_system_prompts: int = 4
    system_tokens: tuple[int, int] = (300, 500)
    """Each system prompt's length is drawn from this range (inclusive, exclusive)."""
    tail_tokens: tuple[int, int] = (40, 70)
    """Each request's own tokens after its system prompt, drawn from this range."""
    system_order: str = "cycle"
    """``cycle``: request r uses system prompt r mod the count (``serve_compare``'s engine
    workload); ``random``: a seeded draw per request."""
    equal_caches: bool = False
    block_size: int = 16
    prefill_tokens_per_s: float = 540.0
    step_base_s: float = 0.06
    step_per_running_s: float = 0.01
    budget_tokens: int = 512
    stats_period_s: float = 1.0
    return_s: float = 0.02
    """From a request's last token to its client's next request reaching the router."""
    jitter: float = 0.0
    """Each step's and each return's time is scaled by a seeded draw from ``1 +- jitter``
    (a shared machine's noise; 0: exact)."""

    def __post_init__(self) -> None:
        for name in ("num_replicas", "concurrency", "num_requests", "output_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClosedLoopConfig.{name} must be positive")
        if self.num_system_prompts <= 0 or self.block_size <= 0 or self.budget_tokens <= 0:
            raise ValueError("system prompts, block size and budget must be positive")
        if self.system_order not in ("cycle", "random"):
            raise ValueError(f"system_order must be cycle or random, got {self.system_order!r}")


@dataclass
class _Request:
    key: str
    system: int
    system_tokens: int
    tail_tokens: int
    arrived_s: float
    tokens_left: int
    prefill_tokens: int = 0
    """What its step computes: set when the step that prefills it starts."""
    first_output_s: float | None = None


@dataclass
class _Replica:
    replica_id: str
    stored: set[int]
    """System prompts this replica holds."""
    queued: list[_Request] = field(default_factory=list)
    running: list[_Request] = field(default_factory=list)
    in_step: list[_Request] | None = None
    """The queued requests the step under way prefills; None while idle."""
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    num_cold_prefills: int = 0

    def uncached(self, request: _Request) -> int:
        held = request.system in self.stored
        return request.tail_tokens + (0 if held else request.system_tokens)

    def report(self, now_s: float, config: ClosedLoopConfig) -> None:
        """What the engine reports: the prompt tokens still to compute of its waiting
        requests and of those the step under way prefills (admitted, so counted running)."""
        in_step = self.in_step or []
        waiting = [r for r in self.queued if r not in in_step]
        running = len(self.running)
        self.stats = ReplicaStats(
            num_waiting=len(waiting),
            num_running=running + len(in_step),
            num_queued_prefill_tokens=(
                sum(self.uncached(r) for r in waiting) + sum(r.prefill_tokens for r in in_step)
            ),
            prefill_tokens_per_s=config.prefill_tokens_per_s,
            decode_tokens_per_s=running / self.decode_step_s(config) if running else 0.0,
            as_of_s=now_s,
            num_empty_kv_blocks=NEVER_FULL_BLOCKS,
        )

    def decode_step_s(self, config: ClosedLoopConfig) -> float:
        return config.step_base_s + config.step_per_running_s * len(self.running)


@dataclass
class Outcome:
    """One replay's figures. TTFTs are of every request; ``warm_ttft_s`` skips the first
    ``concurrency`` (which arrive together, before any cache holds anything)."""

    policy: str
    ttft_s: list[float] = field(default_factory=list)
    warm_ttft_s: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    num_output_tokens: int = 0
    num_cold_prefills: int = 0
    """Prefills of a whole system prompt, over all replicas (copies included)."""
    num_decisions: int = 0
    num_to_longer_queue: int = 0
    """Requests sent to a replica with more prefill tokens queued than another had."""
    imbalance_sum: int = 0
    """Sum over decisions of the spread in requests between the replicas before it."""
    placements: list[str] = field(default_factory=list)
    """Replica id of each request, in the order they were sent."""

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.duration_s if self.duration_s else 0.0

    def summary(self) -> dict:
        return {
            "policy": self.policy,
            "output_tok_s": round(self.output_tokens_per_s, 2),
            "ttft_p50_s": round(percentile(self.ttft_s, 50), 4),
            "ttft_p90_s": round(percentile(self.ttft_s, 90), 4),
            "ttft_p99_s": round(percentile(self.ttft_s, 99), 4),
            "ttft_mean_s": round(statistics.mean(self.ttft_s), 4),
            "warm_ttft_mean_s": round(statistics.mean(self.warm_ttft_s or [0.0]), 4),
            "cold_prefills": self.num_cold_prefills,
        }


def replay(policy: RoutingPolicy, seed: int, config: ClosedLoopConfig | None = None) -> Outcome:
    """Run ``config``'s closed loop through ``policy``; deterministic for ``seed``."""
    config = config or ClosedLoopConfig()
    rng = random.Random(seed)
    clock = _Clock()
    tracker = LoadTracker(clock=clock)
    systems = range(config.num_system_prompts)
    system_tokens = [rng.randrange(*config.system_tokens) for _ in systems]
    stored = set(systems) if config.equal_caches else set()
    replicas = [_Replica(f"r{i}", set(stored)) for i in range(config.num_replicas)]
    speculative: dict[tuple[str, int], float] = {}
    """(replica id, system prompt) -> when a decision sent it there (until it is stored)."""
    events: list[tuple[float, int, _Replica | None]] = []
    """(time, order, the replica whose step ends) or (time, order, None): a client sends."""
    order = itertools.count()
    outcome = Outcome(getattr(policy, "name", type(policy).__name__))
    num_sent = 0
    jitter_rng = random.Random(seed + 1)

    def noise() -> float:
        if not config.jitter:
            return 1.0
        return 1.0 + jitter_rng.uniform(-config.jitter, config.jitter)

    def start_step(replica: _Replica) -> None:
        if replica.in_step is not None or not (replica.queued or replica.running):
            return
        prefills, num_tokens, computing = [], 0, set()
        for request in replica.queued:
            cold = request.system not in replica.stored
            if cold and request.system in computing:
                continue  # in-flight dedup: waits for the request computing its prompt
            tokens = replica.uncached(request)
            if prefills and num_tokens + tokens > config.budget_tokens:
                break
            if cold:
                computing.add(request.system)
            request.prefill_tokens = tokens
            prefills.append(request)
            num_tokens += tokens
        replica.in_step = prefills
        step_s = replica.decode_step_s(config) + num_tokens / config.prefill_tokens_per_s
        step_s *= noise()
        heapq.heappush(events, (clock.now_s + step_s, next(order), replica))

    def send() -> None:
        nonlocal num_sent
        index = num_sent
        num_sent += 1
        if config.system_order == "cycle":
            system = index % config.num_system_prompts
        else:
            system = rng.randrange(config.num_system_prompts)
        tail = rng.randrange(*config.tail_tokens)
        prompt = [system] * system_tokens[system] + [1000 + index] * tail
        held_blocks = system_tokens[system] // config.block_size
        stats = {r.replica_id: r.stats for r in replicas}
        loads = tracker.loads(stats)
        views = [ReplicaView(rid, s, loads[rid]) for rid, s in stats.items()]
        matches = {
            r.replica_id: Match(held_blocks)
            for r in replicas
            if system in r.stored or (r.replica_id, system) in speculative
        }
        hashes = hash_blocks(prompt, config.block_size, "closed-loop")
        decision = policy.choose(hashes, len(prompt), views, matches)
        chosen = loads[decision.replica_id]
        outcome.num_decisions += 1
        outcome.num_to_longer_queue += any(
            load.queued_prefill_tokens < chosen.queued_prefill_tokens for load in loads.values()
        )
        counts = [load.num_requests for load in loads.values()]
        outcome.imbalance_sum += max(counts) - min(counts)
        outcome.placements.append(decision.replica_id)
        replica = next(r for r in replicas if r.replica_id == decision.replica_id)
        if system not in replica.stored:
            speculative[(replica.replica_id, system)] = clock.now_s
        request = _Request(
            f"q{index}", system, system_tokens[system], tail, clock.now_s, config.output_tokens
        )
        matched_tokens = decision.matched_blocks * config.block_size
        tracker.decided(request.key, replica.replica_id, max(0, len(prompt) - matched_tokens))
        tracker.routed(request.key, replica.replica_id)
        replica.queued.append(request)
        start_step(replica)

    next_report_s = 0.0
    for _ in range(min(config.concurrency, config.num_requests)):
        send()
    num_first_outputs = 0
    while num_first_outputs < config.num_requests or events:
        at_s, _, replica = heapq.heappop(events)
        while next_report_s <= at_s:
            clock.now_s = next_report_s
            for r in replicas:
                r.report(next_report_s, config)
            next_report_s += config.stats_period_s
        clock.now_s = at_s
        if replica is None:
            send()
            continue
        finished = []
        for request in replica.running:
            request.tokens_left -= 1
            outcome.num_output_tokens += 1
            if request.tokens_left == 0:
                finished.append(request)
        for request in replica.in_step:
            if request.system not in replica.stored:
                replica.stored.add(request.system)
                speculative.pop((replica.replica_id, request.system), None)
                replica.num_cold_prefills += 1
            replica.queued.remove(request)
            replica.running.append(request)
            request.tokens_left -= 1
            outcome.num_output_tokens += 1
            tracker.first_output(request.key)
            num_first_outputs += 1
            ttft_s = clock.now_s - request.arrived_s
            outcome.ttft_s.append(ttft_s)
            if int(request.key[1:]) >= config.concurrency:
                outcome.warm_ttft_s.append(ttft_s)
        replica.in_step = None
        for request in finished:
            replica.running.remove(request)
            tracker.completed(request.key, replica.replica_id)
        start_step(replica)
        for _ in finished:
            if num_sent < config.num_requests:
                return_s = config.return_s * noise()
                heapq.heappush(events, (clock.now_s + return_s, next(order), None))
        outcome.duration_s = clock.now_s
    outcome.num_cold_prefills = sum(r.num_cold_prefills for r in replicas)
    return outcome


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def policy_named(name: str, **router_config) -> Callable[[], RoutingPolicy]:
    """A factory of the named policy with this replay's block size."""
    return lambda: make_policy(
        RouterConfig(policy=name, block_size=ClosedLoopConfig.block_size, **router_config)
    )


def compare(policies: Sequence[str], seeds: Sequence[int], config: ClosedLoopConfig) -> list[dict]:
    """Per policy: the median over ``seeds`` of each summary figure."""
    rows = []
    for name in policies:
        summaries = [replay(policy_named(name)(), seed, config).summary() for seed in seeds]
        row = {"policy": name}
        for key in summaries[0]:
            if key != "policy":
                row[key] = statistics.median(s[key] for s in summaries)
        rows.append(row)
    return rows


TABLE_COLUMNS = (
    ("output_tok_s", "tok/s"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p90_s", "TTFT p90 s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("cold_prefills", "cold prefills"),
)


def markdown(results: list[dict]) -> str:
    """One table per request count: a row per policy (medians over the seeds)."""
    parts = []
    for result in results:
        config = result["config"]
        parts.append(
            f"### {config['num_requests']} requests, concurrency {config['concurrency']}, "
            f"{config['num_replicas']} replicas, system prompts {config['system_order']}, "
            f"jitter {config['jitter']}\n"
        )
        parts.append("| policy | " + " | ".join(label for _, label in TABLE_COLUMNS) + " |")
        parts.append("|---" * (len(TABLE_COLUMNS) + 1) + "|")
        for row in result["rows"]:
            cells = [
                f"{row[key]:.3f}" if key != "cold_prefills" else f"{row[key]:g}"
                for key, _ in TABLE_COLUMNS
            ]
            parts.append(f"| {row['policy']} | " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)


def plot(results: list[dict], path: Path) -> None:
    """TTFT p50 and p90 per policy, one panel per run length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        rows = result["rows"]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["ttft_p50_s"] for r in rows], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [r["ttft_p90_s"] for r in rows], 0.4, label="p90")
        ax.set_xticks(list(xs), [r["policy"] for r in rows])
        ax.set_title(f"{result['config']['num_requests']} requests")
        ax.set_ylabel("TTFT (s)")
        ax.set_ylim(0, 1.3 * max(r["ttft_p90_s"] for r in rows))
        ax.legend(loc="upper left", ncols=2)
    fig.suptitle("Closed-loop replay: TTFT by policy (median over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", nargs="+", default=["prefix", "round_robin", "least_loaded"])
    p.add_argument("--seeds", type=int, default=8, help="replays per policy (medians)")
    p.add_argument(
        "--num-requests", type=int, nargs="+", default=[64, 256], help="one table per count"
    )
    p.add_argument("--num-replicas", type=int, default=ClosedLoopConfig.num_replicas)
    p.add_argument("--concurrency", type=int, default=ClosedLoopConfig.concurrency)
    p.add_argument("--system-order", choices=("cycle", "random"), default="cycle")
    p.add_argument("--jitter", type=float, default=0.2, help="step and return time noise")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default=None, help="file name suffix (default: the UTC date)")
    args = p.parse_args(argv)
    results = []
    for num_requests in args.num_requests:
        config = ClosedLoopConfig(
            num_replicas=args.num_replicas,
            concurrency=args.concurrency,
            num_requests=num_requests,
            system_order=args.system_order,
            jitter=args.jitter,
        )
        rows = compare(args.policies, range(args.seeds), config)
        results.append({"config": asdict(config), "rows": rows})
        print(f"{num_requests} requests done", file=sys.stderr)
    tag = args.tag or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    stem = args.out_dir / f"closed_loop_{tag}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    header = result_header("closed_loop", "bench.sim.closed_loop", argv)
    stem.with_suffix(".json").write_text(
        json.dumps({"header": header, "seeds": args.seeds, "results": results}, indent=1)
    )
    table = markdown(results)
    stem.with_suffix(".md").write_text(
        f"# Closed-loop replay\n\n`{header['command']}` ({header['cpu']}, "
        f"{header['git_commit']}): medians over {args.seeds} seeds.\n\n{table}\n"
    )
    plot(results, stem.with_suffix(".png"))
    print(table)
    print(f"wrote {stem}.json/.md/.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
