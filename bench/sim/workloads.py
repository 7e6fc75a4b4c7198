"""Seeded, reproducible request streams for the routing simulator.

Every generator returns a ``Workload``: requests as prefix-chained block ids (see ``cache``) with
token counts and Poisson arrival times. These are not HTTP requests and have no text: the
discrete-event simulator only needs which blocks a request shares and when it arrives, at
scales (thousands of requests over 256 replicas) no server run reaches. The serving
benchmarks' HTTP request workloads are ``bench/loadgen/workloads.py``; some shapes share a
name (SGLang's generated-shared-prefix, Zipf prefixes) but not a representation. Sizes scale
with the number of replicas so that each replica sees the same load whatever the cluster
size. Workloads:

- ``generated_shared_prefix``: SGLang's ``generated-shared-prefix`` dataset shape (num_groups,
  prompts_per_group, system_prompt_len, question_len, output_len), requests shuffled.
- ``llmd_shared_prefix``: llm-d's shared-prefix benchmark shape, with the number of groups
  chosen so that the working set is ``capacity_fraction`` (0.73) of the cluster's KV blocks.
- ``mooncake_trace``: a *synthetic* trace in Mooncake's format (timestamp ms, input_length,
  output_length, hash_ids of 512-token blocks) with Zipf-popular roots and growing sessions;
  ``load_mooncake_rows`` accepts a real trace's rows instead.
- ``single_hot_prefix``: one system prompt shared by every request.
- ``zipf_prefixes``: many prefixes with Zipf popularity.

Failure modes: bad sizes raise ``ValueError`` naming the field; the same seed always yields the
same workload (only ``random.Random(seed)`` is used).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.sim.calibration import DEFAULT_RATES

MOONCAKE_BLOCK_TOKENS = 512  # Mooncake's traces hash 512-token blocks
_ZIPF_EXPONENT = 1.1  # a commonly observed popularity skew for prompts and documents


@dataclass(frozen=True)
class Request:
    request_id: int
    arrival_s: float
    block_ids: tuple
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]
    description: str


@dataclass(frozen=True)
class WorkloadScale:
    """How big a workload is, relative to the simulated cluster."""

    num_replicas: int
    capacity_blocks: int
    block_size: int = 16
    requests_per_replica: int = 20
    offered_load: float = 0.8
    """Arrival rate as a fraction of the cluster's prefill capacity with no cache hits."""
    prefill_tokens_per_s: float = DEFAULT_RATES.prefill_tokens_per_s
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_replicas", "capacity_blocks", "block_size", "requests_per_replica"):
            if getattr(self, name) <= 0:
                raise ValueError(f"WorkloadScale.{name} must be positive")
        if not self.offered_load > 0:
            raise ValueError("WorkloadScale.offered_load must be positive")

    @property
    def num_requests(self) -> int:
        return self.num_replicas * self.requests_per_replica


class _Prompts:
    """Builds prefix-chained block ids: a segment's ids depend on the segment before it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids = itertools.count(1)
        self._segments: dict[tuple, tuple] = {}

    def segment(self, key: tuple, num_tokens: int) -> tuple:
        """Block ids of a reusable segment named ``key`` (which must include its parents)."""
        if key not in self._segments:
            self._segments[key] = tuple(
                next(self._ids) for _ in range(num_tokens // self.block_size)
            )
        return self._segments[key]

    def fresh(self, num_tokens: int) -> tuple:
        return tuple(next(self._ids) for _ in range(num_tokens // self.block_size))


def _with_arrivals(
    name: str, prompts: Sequence[tuple[tuple, int, int]], scale: WorkloadScale, rng, description
) -> Workload:
    """Attach Poisson arrivals so the offered load matches ``scale.offered_load``."""
    mean_tokens = sum(p[1] for p in prompts) / len(prompts)
    rate_per_s = scale.offered_load * scale.num_replicas * scale.prefill_tokens_per_s / mean_tokens
    now_s, requests = 0.0, []
    for i, (blocks, num_prompt_tokens, num_output_tokens) in enumerate(prompts):
        now_s += rng.expovariate(rate_per_s)
        requests.append(Request(i, now_s, blocks, num_prompt_tokens, num_output_tokens))
    return Workload(name, tuple(requests), f"{description}; {rate_per_s:.1f} req/s Poisson")


def generated_shared_prefix(
    scale: WorkloadScale,
    *,
    prompts_per_group: int = 16,
    system_prompt_len: int = 1024,
    question_len: int = 128,
    output_len: int = 64,
) -> Workload:
    rng = random.Random(scale.seed)
    p = _Prompts(scale.block_size)
    num_groups = max(1, scale.num_requests // prompts_per_group)
    prompts = []
    for g in range(num_groups):
        system = p.segment(("sys", g), system_prompt_len)
        for _ in range(prompts_per_group):
            blocks = system + p.fresh(question_len)
            prompts.append((blocks, system_prompt_len + question_len, output_len))
    rng.shuffle(prompts)
    desc = (
        f"SGLang generated-shared-prefix: {num_groups} groups x {prompts_per_group} prompts, "
        f"system {system_prompt_len}, question {question_len}, output {output_len} tokens"
    )
    return _with_arrivals("generated_shared_prefix", prompts, scale, rng, desc)


def llmd_shared_prefix(
    scale: WorkloadScale,
    *,
    capacity_fraction: float = 0.73,
    prompts_per_group: int = 5,
    system_prompt_len: int = 1024,
    question_len: int = 256,
    output_len: int = 180,
) -> Workload:
    if not capacity_fraction > 0:
        raise ValueError("capacity_fraction must be positive")
    rng = random.Random(scale.seed)
    p = _Prompts(scale.block_size)
    blocks_per_group = (system_prompt_len + prompts_per_group * question_len) // scale.block_size
    total_blocks = scale.num_replicas * scale.capacity_blocks
    num_groups = max(1, round(capacity_fraction * total_blocks / blocks_per_group))
    prompts = []
    for _ in range(scale.num_requests):
        g, q = rng.randrange(num_groups), rng.randrange(prompts_per_group)
        system = p.segment(("sys", g), system_prompt_len)
        blocks = system + p.segment(("q", g, q), question_len)
        prompts.append((blocks, system_prompt_len + question_len, output_len))
    desc = (
        f"llm-d shared_prefix: {num_groups} groups x {prompts_per_group} questions, working set "
        f"{capacity_fraction:.0%} of {total_blocks} cluster blocks"
    )
    return _with_arrivals("llmd_shared_prefix_73", prompts, scale, rng, desc)


def synthesize_mooncake_rows(scale: WorkloadScale, *, continue_prob: float = 0.6) -> list[dict]:
    """Rows in Mooncake's trace format; synthetic (no real trace ships with this repo)."""
    rng = random.Random(scale.seed)
    num_roots = max(2, scale.num_replicas)
    weights = [1.0 / (k + 1) ** _ZIPF_EXPONENT for k in range(num_roots)]
    next_hash = itertools.count(1)
    roots = [[next(next_hash) for _ in range(rng.randint(1, 3))] for _ in range(num_roots)]
    sessions: dict[int, list[list[int]]] = {}
    rows, now_ms = [], 0.0
    for _ in range(scale.num_requests):
        root = rng.choices(range(num_roots), weights)[0]
        open_sessions = sessions.setdefault(root, [])
        if open_sessions and rng.random() < continue_prob:
            session = rng.choice(open_sessions)
            session.append(next(next_hash))
            if len(session) >= 8:  # long conversations end; keeps prompts bounded
                open_sessions.remove(session)
        else:
            session = roots[root] + [next(next_hash)]
            open_sessions.append(session)
        input_length = len(session) * MOONCAKE_BLOCK_TOKENS - rng.randrange(MOONCAKE_BLOCK_TOKENS)
        now_ms += 1.0
        rows.append(
            {
                "timestamp": int(now_ms),
                "input_length": input_length,
                "output_length": rng.randint(32, 128),
                "hash_ids": list(session),
            }
        )
    return rows


def load_mooncake_rows(rows: Sequence[dict], scale: WorkloadScale, name: str) -> Workload:
    """Turn Mooncake rows into requests; arrivals are re-drawn to match the offered load."""
    rng = random.Random(scale.seed + 1)
    per_hash = MOONCAKE_BLOCK_TOKENS // scale.block_size
    prompts = []
    for row in rows:
        blocks = tuple(h * per_hash + j for h in row["hash_ids"] for j in range(per_hash))
        num_full = row["input_length"] // scale.block_size
        prompts.append((blocks[:num_full], row["input_length"], row["output_length"]))
    return _with_arrivals(name, prompts, scale, rng, "Mooncake-format trace")


def mooncake_trace(scale: WorkloadScale) -> Workload:
    wl = load_mooncake_rows(synthesize_mooncake_rows(scale), scale, "mooncake_synthetic")
    return Workload(wl.name, wl.requests, "SYNTHETIC " + wl.description)


def single_hot_prefix(
    scale: WorkloadScale, *, system_prompt_len: int = 2048, question_len: int = 256
) -> Workload:
    rng = random.Random(scale.seed)
    p = _Prompts(scale.block_size)
    system = p.segment(("sys",), system_prompt_len)
    prompts = [
        (system + p.fresh(question_len), system_prompt_len + question_len, 64)
        for _ in range(scale.num_requests)
    ]
    desc = f"one {system_prompt_len}-token prefix shared by all, {question_len}-token questions"
    return _with_arrivals("single_hot_prefix", prompts, scale, rng, desc)


def zipf_prefixes(
    scale: WorkloadScale,
    *,
    prefixes_per_replica: int = 2,
    prefix_len: int = 1024,
    question_len: int = 128,
) -> Workload:
    rng = random.Random(scale.seed)
    p = _Prompts(scale.block_size)
    num_prefixes = prefixes_per_replica * scale.num_replicas
    weights = [1.0 / (k + 1) ** _ZIPF_EXPONENT for k in range(num_prefixes)]
    prompts = []
    for k in rng.choices(range(num_prefixes), weights, k=scale.num_requests):
        blocks = p.segment(("pre", k), prefix_len) + p.fresh(question_len)
        prompts.append((blocks, prefix_len + question_len, 64))
    desc = f"{num_prefixes} prefixes of {prefix_len} tokens, Zipf({_ZIPF_EXPONENT}) popularity"
    return _with_arrivals("zipf_prefixes", prompts, scale, rng, desc)


WORKLOADS: dict[str, Callable[[WorkloadScale], Workload]] = {
    "generated_shared_prefix": generated_shared_prefix,
    "llmd_shared_prefix_73": llmd_shared_prefix,
    "mooncake_synthetic": mooncake_trace,
    "single_hot_prefix": single_hot_prefix,
    "zipf_prefixes": zipf_prefixes,
}
