"""Equal caches, a closed loop: the load-aware policies must spread requests at least as
evenly as round robin.

Every replica holds every prefix, so only load tells the replicas apart. The policies
(``router.policies``) decide on views built as the request router builds them: the
replicas' stats, refreshed once per ``STATS_PERIOD_S``, merged by ``router.load`` with a
``LoadTracker`` told each decision, first output and completion. The replicas follow a
deterministic model of the engine: back-to-back steps, each computing one token of every
running request and the queued prefills (first come, first served) up to
``BUDGET_TOKENS``, priced ``STEP_BASE_S + STEP_PER_RUNNING_S * running + prefill tokens /
PREFILL_TOKENS_PER_S``. A request's first output comes at the end of the step that computed
its prefill. Clients send their next request ``RETURN_S`` after the last one finished; every
request decodes ``OUTPUT_TOKENS`` (a benchmark's ``max_tokens`` with ``ignore_eos``), so
requests that prefill together finish together.

"Evenly": no more requests sent to a replica with a longer prefill queue than another's, no
larger spread in requests between the replicas, and a mean TTFT within 2% of round robin's.
Counting requests alone does not spread them (``CountFirst``): the requests that finish
together on one replica leave it the fewest, their successors all go there and prefill in
one step, and finish together again.
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from dataclasses import dataclass, field

import pytest

from router.config import RouterConfig
from router.index_types import Match
from router.load import LoadTracker
from router.policies import make_policy
from router.policy import Decision, ReplicaView, RoutingPolicy, RoutingReason
from router.protocol import ReplicaStats, hash_blocks

BLOCK_SIZE = 16
NUM_REPLICAS = 2
CONCURRENCY = 8
NUM_REQUESTS = 320
OUTPUT_TOKENS = 64
SYSTEM_PROMPTS = 3
PREFILL_TOKENS_PER_S = 400.0
STEP_BASE_S = 0.03
STEP_PER_RUNNING_S = 0.005
BUDGET_TOKENS = 512
STATS_PERIOD_S = 1.0
RETURN_S = 0.02
"""From a request's last token to its client's next request reaching the router (the stream's
end through the ingress and the proxy, the next request back through them)."""
SEEDS = range(4)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class Request:
    key: str
    prefill_tokens: int
    arrived_s: float
    tokens_left: int = OUTPUT_TOKENS


@dataclass
class Replica:
    replica_id: str
    queued: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    in_step: list[Request] | None = None
    """The queued requests the step under way prefills; None while idle."""
    stats: ReplicaStats = field(default_factory=ReplicaStats)

    def report(self, now_s: float) -> None:
        """What the engine reports: waiting requests' whole prompts are queued tokens."""
        in_step = self.in_step or []
        waiting = [r for r in self.queued if r not in in_step]
        self.stats = ReplicaStats(
            num_waiting=len(waiting),
            num_running=len(self.running) + len(in_step),
            num_queued_prefill_tokens=sum(r.prefill_tokens for r in self.queued),
            prefill_tokens_per_s=PREFILL_TOKENS_PER_S,
            decode_tokens_per_s=len(self.running) / self.decode_step_s() if self.running else 0,
            as_of_s=now_s,
        )

    def decode_step_s(self) -> float:
        return STEP_BASE_S + STEP_PER_RUNNING_S * len(self.running)


@dataclass
class Outcome:
    ttft_s: list[float] = field(default_factory=list)
    """Of the requests after the first ``CONCURRENCY`` (which all arrive at once)."""
    num_decisions: int = 0
    num_to_longer_queue: int = 0
    """Requests sent to a replica with more prefill tokens queued than another had."""
    imbalance_sum: int = 0
    """Sum over decisions of the spread in requests between the replicas before it."""


class CountFirst:
    """Least loaded by request count alone (what the baselines did before ``load_rank``)."""

    name = "count_first"

    def choose(self, block_hashes, num_prompt_tokens, replicas, matches) -> Decision:
        view = min(replicas, key=lambda v: (v.load.num_requests, v.replica_id))
        return Decision(view.replica_id, 0.0, 0, RoutingReason.BASELINE)


def replay(policy: RoutingPolicy, seed: int) -> Outcome:
    rng = random.Random(seed)
    clock = Clock()
    tracker = LoadTracker(clock=clock)
    replicas = [Replica(f"r{i}") for i in range(NUM_REPLICAS)]
    system_tokens = [rng.randrange(350, 500) for _ in range(SYSTEM_PROMPTS)]
    events: list[tuple[float, int, Replica | None]] = []
    """(time, order, the replica whose step ends) or (time, order, None): a client sends."""
    order = itertools.count()
    outcome = Outcome()
    requests: list[Request] = []

    def start_step(replica: Replica) -> None:
        if replica.in_step is not None or not (replica.queued or replica.running):
            return
        prefills, num_tokens = [], 0
        for request in replica.queued:
            if prefills and num_tokens + request.prefill_tokens > BUDGET_TOKENS:
                break
            prefills.append(request)
            num_tokens += request.prefill_tokens
        replica.in_step = prefills
        step_s = replica.decode_step_s() + num_tokens / PREFILL_TOKENS_PER_S
        heapq.heappush(events, (clock.now_s + step_s, next(order), replica))

    def send() -> None:
        system = rng.randrange(SYSTEM_PROMPTS)
        tail = [1000 + len(requests)] * rng.randrange(60, 140)
        prompt = [system] * system_tokens[system] + tail
        held = system_tokens[system] // BLOCK_SIZE
        stats = {r.replica_id: r.stats for r in replicas}
        loads = tracker.loads(stats)
        views = [ReplicaView(rid, s, loads[rid]) for rid, s in stats.items()]
        matches = {r.replica_id: Match(held) for r in replicas}  # equal caches
        hashes = hash_blocks(prompt, BLOCK_SIZE, "closed-loop")
        decision = policy.choose(hashes, len(prompt), views, matches)
        chosen = loads[decision.replica_id]
        outcome.num_decisions += 1
        outcome.num_to_longer_queue += any(
            load.queued_prefill_tokens < chosen.queued_prefill_tokens for load in loads.values()
        )
        counts = [load.num_requests for load in loads.values()]
        outcome.imbalance_sum += max(counts) - min(counts)
        replica = next(r for r in replicas if r.replica_id == decision.replica_id)
        request = Request(f"q{len(requests)}", len(prompt) - held * BLOCK_SIZE, clock.now_s)
        requests.append(request)
        tracker.decided(request.key, replica.replica_id, request.prefill_tokens)
        tracker.routed(request.key, replica.replica_id)
        replica.queued.append(request)
        start_step(replica)

    next_report_s = 0.0
    for _ in range(CONCURRENCY):
        send()
    num_first_outputs = 0
    while num_first_outputs < NUM_REQUESTS:
        at_s, _, replica = heapq.heappop(events)
        while next_report_s <= at_s:
            clock.now_s = next_report_s
            for r in replicas:
                r.report(next_report_s)
            next_report_s += STATS_PERIOD_S
        clock.now_s = at_s
        if replica is None:
            send()
            continue
        finished = []
        for request in replica.running:
            request.tokens_left -= 1
            if request.tokens_left == 0:
                finished.append(request)
        for request in replica.in_step:
            replica.queued.remove(request)
            replica.running.append(request)
            request.tokens_left -= 1
            tracker.first_output(request.key)
            num_first_outputs += 1
            if int(request.key[1:]) >= CONCURRENCY:
                outcome.ttft_s.append(clock.now_s - request.arrived_s)
        replica.in_step = None
        for request in finished:
            replica.running.remove(request)
            tracker.completed(request.key, replica.replica_id)
        start_step(replica)
        for _ in finished:
            heapq.heappush(events, (clock.now_s + RETURN_S, next(order), None))
    return outcome


def summary(policy_factory) -> tuple[float, float, float]:
    """(mean TTFT, share of requests sent to a longer prefill queue, mean spread in requests
    between the replicas at a decision) over ``SEEDS``."""
    outcomes = [replay(policy_factory(), seed) for seed in SEEDS]
    num_decisions = sum(o.num_decisions for o in outcomes)
    return (
        statistics.mean(t for o in outcomes for t in o.ttft_s),
        sum(o.num_to_longer_queue for o in outcomes) / num_decisions,
        sum(o.imbalance_sum for o in outcomes) / num_decisions,
    )


def policy_named(name: str):
    return lambda: make_policy(RouterConfig(policy=name, block_size=BLOCK_SIZE))


@pytest.fixture(scope="module")
def round_robin() -> tuple[float, float, float]:
    return summary(policy_named("round_robin"))


@pytest.mark.parametrize("policy_name", ["prefix", "least_loaded", "pow2"])
def test_load_aware_policies_spread_a_closed_loop_at_least_as_evenly_as_round_robin(
    policy_name, round_robin
):
    ttft_s, to_longer_queue, imbalance = summary(policy_named(policy_name))
    ttft_rr_s, to_longer_queue_rr, imbalance_rr = round_robin
    assert to_longer_queue <= to_longer_queue_rr, (to_longer_queue, to_longer_queue_rr)
    assert imbalance <= imbalance_rr, (imbalance, imbalance_rr)
    assert ttft_s <= 1.02 * ttft_rr_s, (ttft_s, ttft_rr_s)


def test_counting_requests_alone_locks_a_closed_loop_into_cohorts(round_robin):
    """The replay tells a bad load model apart: by request count alone, the successors of the
    requests that finished together on one replica all go to it and prefill in one step."""
    ttft_s, to_longer_queue, _ = summary(CountFirst)
    ttft_rr_s, to_longer_queue_rr, _ = round_robin
    assert to_longer_queue > 5 * to_longer_queue_rr
    assert ttft_s > 1.5 * ttft_rr_s
