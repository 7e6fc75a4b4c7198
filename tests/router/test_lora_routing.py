"""Routing requests on LoRA adapters: the prefix policy charges a replica without the
request's adapter the adapter's load, the router counts a replica it just sent the adapter as
holding it, base-model requests and the baselines are unaffected."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from router.config import RouterConfig
from router.embedded_index import EmbeddedIndex
from router.index_types import Match
from router.load import ReplicaLoad, replica_load
from router.policies import make_policy
from router.policy import DEFAULT_LORA_LOAD_S, ReplicaView, RoutingReason, adapter_load_s
from router.protocol import ReplicaStats, adapter_namespace, hash_blocks
from router.recent_decisions import RecentAdapters
from router.routing import Router

BLOCK_SIZE = 16
CONFIG = RouterConfig(max_load_ratio=None)  # 8000 prefill tokens/s, 0.02 s decode step
NUM_TOKENS = 256


def blocks(first_token: int, lora_name: str | None = "x") -> list[bytes]:
    tokens = [first_token] + [7] * (NUM_TOKENS - 1)
    return hash_blocks(tokens, BLOCK_SIZE, adapter_namespace("lora-model", lora_name))


def idle(replica_id: str, **stats) -> ReplicaView:
    """A replica whose stats are its whole load (no tracked requests)."""
    replica_stats = ReplicaStats(**stats)
    return ReplicaView(replica_id, replica_stats, replica_load(replica_stats))


def test_an_adapters_requests_go_to_the_replica_holding_it_when_loads_are_equal():
    replicas = [idle("a", lora_load_s=0.1), idle("b", lora_adapters=("x",)), idle("c")]
    policy = make_policy(CONFIG)
    chosen = collections.Counter()
    for first in range(40):  # cold prompts: without the adapter, rendezvous spreads them
        decision = policy.choose(blocks(first), NUM_TOKENS, replicas, {}, lora_name="x")
        chosen[decision.replica_id] += 1
        assert decision.reason == RoutingReason.SHORTEST_QUEUE
        assert decision.predicted_ttft_s == pytest.approx(NUM_TOKENS / 8000.0)
    assert chosen == {"b": 40}
    # Another adapter, held nowhere: every replica pays a load, and the prompts spread.
    spread = {
        policy.choose(blocks(first, "y"), NUM_TOKENS, replicas, {}, lora_name="y").replica_id
        for first in range(40)
    }
    assert len(spread) > 1


@pytest.mark.parametrize(("margin_s", "expected"), [(-0.01, "holder"), (0.01, "other")])
def test_the_holder_loses_the_adapters_requests_once_its_queue_costs_more_than_the_load(
    margin_s, expected
):
    """The holder's queue against the load elsewhere, both weighted as the policy weighs them:
    the queue and the holder's busy step against ``miss_cost_factor`` x the load."""
    load_s, rate, step_s = 0.1, 8000.0, 0.02
    factor = CONFIG.miss_cost_factor
    queued_s = factor * load_s - 2 * step_s + margin_s  # one queued request, one busy step
    holder = ReplicaView(
        "holder",
        ReplicaStats(lora_adapters=("x",), lora_load_s=load_s),
        ReplicaLoad(num_queued=1, queued_prefill_tokens=round(queued_s * rate)),
    )
    other = idle("other", lora_load_s=load_s)
    decision = make_policy(CONFIG).choose(blocks(1), NUM_TOKENS, [holder, other], {}, lora_name="x")
    assert decision.replica_id == expected
    if expected == "other":  # its own TTFT includes the load, unweighted
        assert decision.predicted_ttft_s == pytest.approx(NUM_TOKENS / rate + load_s)


def test_base_model_requests_are_priced_as_if_no_replica_held_an_adapter():
    holding = [idle("a", lora_adapters=("x",), lora_load_s=0.1), idle("b"), idle("c")]
    plain = [idle("a"), idle("b"), idle("c")]
    with_adapters, without = make_policy(CONFIG), make_policy(CONFIG)
    for first in range(40):
        hashes = blocks(first, None)
        assert with_adapters.choose(hashes, NUM_TOKENS, holding, {}) == without.choose(
            hashes, NUM_TOKENS, plain, {}
        )


def test_a_replica_that_measured_no_load_is_charged_the_others_median_or_the_default():
    replicas = [
        idle("holds", lora_adapters=("x",)),
        idle("fast", lora_load_s=0.01),
        idle("slow", lora_load_s=0.03),
        idle("mid", lora_load_s=0.02),
        idle("new"),
    ]
    assert adapter_load_s(replicas, "x") == {
        "holds": 0.0,
        "fast": 0.01,
        "slow": 0.03,
        "mid": 0.02,
        "new": 0.02,
    }
    assert adapter_load_s([idle("a"), idle("b")], "x") == {
        "a": DEFAULT_LORA_LOAD_S,
        "b": DEFAULT_LORA_LOAD_S,
    }
    assert adapter_load_s(replicas, None) == dict.fromkeys(
        ("holds", "fast", "slow", "mid", "new"), 0.0
    )


def test_a_load_within_the_tie_tolerance_still_prefers_the_holder():
    # A 1 ms load (2 ms weighted) is within the 5 ms tolerance: a tie, which the holder wins.
    replicas = [idle(r, lora_load_s=0.001) for r in "abc"]
    replicas[2] = idle("c", lora_adapters=("x",), lora_load_s=0.001)
    policy = make_policy(CONFIG)
    for first in range(20):
        decision = policy.choose(blocks(first), NUM_TOKENS, replicas, {}, lora_name="x")
        assert (decision.replica_id, decision.reason) == ("c", RoutingReason.COLD)


@pytest.mark.parametrize(("load_s", "expected"), [(0.05, "prefix"), (0.2, "adapter")])
def test_the_prefix_holder_without_the_adapter_wins_while_the_load_costs_less_than_the_prefill(
    load_s, expected
):
    # 1024 tokens; the prefix's holder has 960 of them cached but lacks the adapter. Priced
    # with miss_cost_factor 2: 64 tokens' prefill + the load there, against 1024 tokens'
    # prefill on the adapter's holder (0.256 s).
    num_tokens = 1024
    hashes = hash_blocks([3] * num_tokens, BLOCK_SIZE, adapter_namespace("lora-model", "x"))
    replicas = [idle("prefix", lora_load_s=load_s), idle("adapter", lora_adapters=("x",))]
    decision = make_policy(CONFIG).choose(
        hashes, num_tokens, replicas, {"prefix": Match(60)}, lora_name="x"
    )
    assert decision.replica_id == expected
    if expected == "prefix":
        assert decision.reason == RoutingReason.PREFIX
        assert decision.predicted_ttft_s == pytest.approx(64 / 8000.0 + load_s)
    else:
        assert decision.reason == RoutingReason.SHORTEST_QUEUE and decision.matched_blocks == 0


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "pow2"])
def test_the_baselines_ignore_the_adapter(name):
    replicas = [idle("a", lora_adapters=("x",), lora_load_s=0.5), idle("b"), idle("c")]
    config = dataclasses.replace(CONFIG, policy=name)
    with_adapter, without = make_policy(config), make_policy(config)
    for first in range(12):
        hashes = blocks(first)
        decision = with_adapter.choose(hashes, NUM_TOKENS, replicas, {}, lora_name="x")
        assert decision == without.choose(hashes, NUM_TOKENS, replicas, {})
        assert decision.reason == RoutingReason.BASELINE


def _router(policy: str = "prefix") -> Router:
    config = dataclasses.replace(CONFIG, policy=policy)
    return Router(config, "lora-model", index=EmbeddedIndex(), speculate_in_background=False)


def test_a_burst_of_an_adapters_requests_follows_the_first_one_before_any_stats_say_so():
    # No replica holds "x" in its stats, which stay as they were for the whole burst.
    replicas = [idle(r) for r in "abc"]
    with _router() as router:
        chosen = [
            router.route(blocks(first), NUM_TOKENS, replicas, lora_name="x").replica_id
            for first in range(8)
        ]
        assert len(set(chosen)) == 1, chosen
        # Base-model requests do not follow it: rendezvous spreads their cold prompts.
        base = {
            router.route(blocks(first, None), NUM_TOKENS, replicas).replica_id
            for first in range(20)
        }
        assert len(base) > 1


def test_a_baseline_router_keeps_no_adapter_history():
    replicas = [idle(r) for r in "abc"]
    with _router("round_robin") as router:
        chosen = [
            router.route(blocks(first), NUM_TOKENS, replicas, lora_name="x").replica_id
            for first in range(3)
        ]
    assert sorted(chosen) == ["a", "b", "c"]


def test_route_tokens_hashes_in_the_adapters_namespace():
    with _router() as router:
        token_ids = list(range(NUM_TOKENS))
        assert router.hash_prompt(token_ids, lora_name="x") == hash_blocks(
            token_ids, BLOCK_SIZE, adapter_namespace("lora-model", "x")
        )
        assert router.hash_prompt(token_ids, lora_name="x") != router.hash_prompt(token_ids)
        decision = router.route_tokens(token_ids, [idle("a")], lora_name="x")
        assert decision.replica_id == "a"


def test_recent_adapters_expire_after_their_ttl():
    now = [0.0]
    recent = RecentAdapters(ttl_s=5.0, clock=lambda: now[0], max_adapters=2)
    recent.record("a", "x")
    now[0] = 3.0
    recent.record("b", "x")
    assert recent.holders("x") == {"a", "b"}
    assert recent.holders("y") == set()
    now[0] = 6.0
    assert recent.holders("x") == {"b"}
    now[0] = 9.0
    assert recent.holders("x") == set()
    recent.record("a", "y")
    recent.record("a", "z")
    recent.record("c", "w")  # past max_adapters: the least recently sent adapter goes
    assert recent.holders("y") == set() and recent.holders("w") == {"c"}
