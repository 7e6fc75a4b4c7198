"""Equal caches, a closed loop: the load-aware policies must spread requests at least as
evenly as round robin.

Every replica holds every prefix, so only load tells the replicas apart. The replay
(``bench.sim.closed_loop``) decides with the real policies on views built as the request
router builds them (stats once a second merged with a ``LoadTracker`` told each decision,
first output and completion) over a step-level model of the engine, clients sending their
next request when the last one ended; every request decodes the same number of tokens, so
requests that prefill together finish together.

"Evenly": no more requests sent to a replica with a longer prefill queue than another's, no
larger spread in requests between the replicas, and a mean TTFT within 2% of round robin's.
Counting requests alone does not spread them (``CountFirst``): the requests that finish
together on one replica leave it the fewest, their successors all go there and prefill in
one step, and finish together again.
"""

from __future__ import annotations

import statistics

import pytest

from bench.sim.closed_loop import ClosedLoopConfig, Outcome, policy_named, replay
from router.policy import Decision, RoutingReason

CONFIG = ClosedLoopConfig(
    num_replicas=2,
    concurrency=8,
    num_requests=320,
    output_tokens=64,
    num_system_prompts=3,
    system_tokens=(350, 500),
    tail_tokens=(60, 140),
    system_order="random",
    equal_caches=True,
    prefill_tokens_per_s=400.0,
    step_base_s=0.03,
    step_per_running_s=0.005,
)
SEEDS = range(8)


class CountFirst:
    """Least loaded by request count alone (what the baselines did before ``load_rank``)."""

    name = "count_first"

    def choose(self, block_hashes, num_prompt_tokens, replicas, matches) -> Decision:
        view = min(replicas, key=lambda v: (v.load.num_requests, v.replica_id))
        return Decision(view.replica_id, 0.0, 0, RoutingReason.BASELINE)


def summary(policy_factory) -> tuple[float, float, float]:
    """(mean TTFT after the first wave, share of requests sent to a longer prefill queue, mean
    spread in requests between the replicas at a decision) over ``SEEDS``."""
    outcomes: list[Outcome] = [replay(policy_factory(), seed, CONFIG) for seed in SEEDS]
    num_decisions = sum(o.num_decisions for o in outcomes)
    return (
        statistics.mean(t for o in outcomes for t in o.warm_ttft_s),
        sum(o.num_to_longer_queue for o in outcomes) / num_decisions,
        sum(o.imbalance_sum for o in outcomes) / num_decisions,
    )


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
