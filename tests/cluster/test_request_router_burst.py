"""The request router under a burst, without Ray: decisions whose index lookups ran at the
same time still see each other (a real 3-replica run sent 7 of a burst's 8 cold
prompts to one replica).

``PrefixAwareRequestRouter`` itself, driven with Serve's ``PendingRequest`` and stand-ins for
``RunningReplica`` whose routing stats are stale (Serve refreshes them once a second); the
index is an ``EmbeddedIndex`` whose answers arrive 20 ms after it was asked, so every lookup
of the burst is in flight before the first decision is made.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

from cluster.request_router import PrefixAwareRequestRouter
from router.embedded_index import EmbeddedIndex
from router.load import ReplicaLoad
from router.policy import ReplicaView, pooled_prefill_rate
from router.protocol import ReplicaStats, hash_blocks
from tests.cluster.helpers import pending, request_router, running

BLOCK_SIZE = 16
MODEL_ID = "burst-model"
NUM_PROMPT_TOKENS = 480  # 30 blocks
LOOKUP_S = 0.02


class SlowIndex(EmbeddedIndex):
    """Answers with what it held when asked, ``LOOKUP_S`` later (a round trip)."""

    def match(self, block_hashes):
        answer = super().match(block_hashes)
        time.sleep(LOOKUP_S)
        return answer


def slow_router(replica_ids) -> PrefixAwareRequestRouter:
    index = SlowIndex()
    for replica_id in replica_ids:  # live: the index counts their (speculative) entries
        index.heartbeat(replica_id, 0)
    return request_router({"block_size": BLOCK_SIZE, "max_load_ratio": None}, index, MODEL_ID)


def prompt(first_token: int) -> tuple[list[int], list[bytes]]:
    ids = [first_token] + [7] * (NUM_PROMPT_TOKENS - 1)
    return ids, hash_blocks(ids, BLOCK_SIZE, MODEL_ID, None)


def burst(router, candidates, prompts) -> list[str]:
    """Every prompt's decision, made concurrently; the chosen replica of each."""

    async def main():
        calls = [pending(f"r{i}", ids, hashes) for i, (ids, hashes) in enumerate(prompts)]
        ranks = await asyncio.gather(*(router.choose_replicas(candidates, c) for c in calls))
        return [r[0][0].replica_id.unique_id for r in ranks]

    return asyncio.run(main())


def test_a_burst_of_cold_prompts_spreads_by_the_prefill_each_decision_queued():
    # The last stats say every replica is idle; "fast" measured a 1.5x prefill rate.
    candidates = [
        running("fast", prefill_tokens_per_s=300.0),
        running("slow-1", prefill_tokens_per_s=200.0),
        running("slow-2", prefill_tokens_per_s=200.0),
    ]
    router = slow_router(["fast", "slow-1", "slow-2"])
    chosen = burst(router, candidates, [prompt(100 + i) for i in range(6)])
    counts = collections.Counter(chosen)
    # As one decode step each, all 6 went to "fast"; priced by their prefill, ~2.6 : 1.7 : 1.7.
    assert counts["fast"] <= 3 and len(counts) == 3, counts


def test_siblings_in_one_burst_follow_the_first_one():
    candidates = [running(name, prefill_tokens_per_s=200.0) for name in ("a", "b", "c")]
    shared = prompt(5)
    chosen = burst(slow_router("abc"), candidates, [shared] * 3 + [prompt(6)])
    # The shared prompt's three copies go where the first went (they would prefill it once
    # there); the cold prompt goes elsewhere.
    assert len(set(chosen[:3])) == 1, chosen
    assert chosen[3] != chosen[0], chosen


def test_replicas_that_measured_are_priced_at_one_rate_the_median():
    def view(**stats) -> ReplicaView:
        return ReplicaView("r", ReplicaStats(**stats), ReplicaLoad(num_running=8))

    views = [
        view(prefill_tokens_per_s=190.0, num_running=8),
        view(prefill_tokens_per_s=80.0),
        view(prefill_tokens_per_s=120.0),
        view(),  # measured nothing yet
    ]
    pooled = pooled_prefill_rate(views)
    # The median of 190, 80 and 120; the replica that measured nothing keeps the default.
    assert [v.stats.prefill_tokens_per_s for v in pooled] == [120.0, 120.0, 120.0, 0.0]
    # Every other field as it was; a view already at the median is not copied.
    assert pooled[0].stats == dataclasses.replace(views[0].stats, prefill_tokens_per_s=120.0)
    assert pooled[0].load == views[0].load and pooled[2] is views[2]
    assert pooled_prefill_rate([view()]) == [view()]


def test_a_replicas_stats_are_parsed_once_per_report():
    router = request_router({"block_size": BLOCK_SIZE}, EmbeddedIndex(), MODEL_ID)
    candidates = [running("a", prefill_tokens_per_s=100.0), running("b", num_running=2)]
    first = router._views(candidates)
    again = router._views(candidates)
    assert [v.stats for v in again] == [v.stats for v in first]
    assert all(a.stats is b.stats for a, b in zip(again, first, strict=True))  # not parsed again
    candidates[0] = running("a", prefill_tokens_per_s=150.0)  # Serve hands over a new report
    fresh = router._views(candidates)
    assert fresh[0].stats.prefill_tokens_per_s == 150.0
    assert fresh[1].stats is first[1].stats
    assert [v.replica_id for v in router._views(candidates[1:])] == ["b"]  # "a" left


def test_a_replica_that_measured_a_slow_prefill_still_gets_cold_prompts():
    # "busy" measured fast while batching, "idle" slow while contended: by their own rates
    # the idle replica looked dear for every cold prompt and was never tried again.
    candidates = [
        running("busy", prefill_tokens_per_s=190.0, num_running=3),
        running("idle", prefill_tokens_per_s=80.0),
    ]
    chosen = burst(slow_router(["busy", "idle"]), candidates, [prompt(200)])
    assert chosen == ["idle"]
