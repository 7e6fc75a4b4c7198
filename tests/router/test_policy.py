"""Routing policies: predicted-TTFT choice, rendezvous agreement, spill, baselines."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from router.config import RouterConfig
from router.index_types import Match
from router.load import ReplicaLoad, replica_load
from router.policies import make_policy
from router.policy import (
    ReplicaView,
    RoutingReason,
    TTFTModel,
    peer_device_blocks,
    rendezvous_pick,
)
from router.protocol import ReplicaStats, hash_blocks

BLOCK_SIZE = 16
CONFIG = RouterConfig()  # default rates: 8000 prefill tokens/s, 0.02 s decode step


def prompt_blocks(first_token: int, num_blocks: int = 8) -> list[bytes]:
    tokens = [first_token] + [7] * (num_blocks * BLOCK_SIZE - 1)
    return hash_blocks(tokens, BLOCK_SIZE, "policy-model")


def idle(replica_id: str, **stats) -> ReplicaView:
    """A replica whose stats are its whole load (no tracked requests)."""
    replica_stats = ReplicaStats(**stats)
    return ReplicaView(replica_id, replica_stats, replica_load(replica_stats))


def test_cold_start_spreads_by_rendezvous_and_independent_routers_agree():
    replicas = [idle(f"r{i}") for i in range(4)]
    router_a, router_b = make_policy(CONFIG), make_policy(CONFIG)
    counts = collections.Counter()
    for prefix in range(400):
        blocks = prompt_blocks(prefix)
        a = router_a.choose(blocks, len(blocks) * BLOCK_SIZE, replicas, {})
        b = router_b.choose(blocks, len(blocks) * BLOCK_SIZE, list(reversed(replicas)), {})
        assert a == b
        assert a.reason == "cold" and a.matched_blocks == 0
        counts[a.replica_id] += 1
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert all(60 <= n <= 140 for n in counts.values()), counts


def test_rendezvous_moves_only_the_removed_replicas_prefixes():
    ids = [f"r{i}" for i in range(5)]
    keys = [prompt_blocks(p)[0] for p in range(200)]
    before = {k: rendezvous_pick(k, ids) for k in keys}
    after = {k: rendezvous_pick(k, ids[:-1]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r4" for k in moved)


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_hot_prefix_spills_exactly_when_that_lowers_the_priced_ttft(factor):
    """Spill when the holder's queue costs more than re-prefilling elsewhere, the miss's
    prefill weighted by ``miss_cost_factor`` (1: the request's own TTFT only)."""
    config = dataclasses.replace(CONFIG, miss_cost_factor=factor)
    policy = make_policy(config)
    blocks = prompt_blocks(1, num_blocks=128)  # 2048 tokens
    num_tokens = 2048
    matches = {"holder": Match(device_blocks=120)}  # holds 1920 tokens
    rate = CONFIG.default_prefill_tokens_per_s
    step_s = CONFIG.default_decode_step_s
    cold_cost_s = factor * num_tokens / rate
    # A queue on the holder such that it is 10 ms better, then 10 ms worse than the empty
    # replica: one queued request costs its tokens, a decode step, and the holder is busy
    # (one more step for the request's own prefill).
    for margin_s, expected in ((-0.01, "holder"), (0.01, "other")):
        queued_s = cold_cost_s - factor * (num_tokens - 1920) / rate + margin_s - 2 * step_s
        load = ReplicaLoad(num_queued=1, queued_prefill_tokens=round(queued_s * rate))
        holder = ReplicaView("holder", ReplicaStats(), load)
        decision = policy.choose(blocks, num_tokens, [holder, idle("other")], matches)
        assert decision.replica_id == expected
        chosen = holder if expected == "holder" else idle("other")
        own_ttft_s = TTFTModel(CONFIG).predicted_ttft_s(chosen, matches.get(expected), num_tokens)
        assert decision.predicted_ttft_s == pytest.approx(own_ttft_s)  # reported unweighted
        assert decision.reason == (
            RoutingReason.PREFIX if expected == "holder" else RoutingReason.SHORTEST_QUEUE
        )
        assert decision.matched_blocks == (120 if expected == "holder" else 0)


def test_a_second_holder_shares_the_hot_prefix_by_load():
    policy = make_policy(CONFIG)
    blocks = prompt_blocks(2, num_blocks=64)
    matches = {"a": Match(64), "b": Match(64)}
    busy_a = idle("a", num_waiting=3)
    decision = policy.choose(blocks, 1024, [busy_a, idle("b"), idle("c")], matches)
    assert (decision.replica_id, decision.reason) == ("b", "prefix")
    # Equal load: a tie between the two holders, never the non-holder.
    decision = policy.choose(blocks, 1024, [idle("a"), idle("b"), idle("c")], matches)
    assert decision.replica_id in ("a", "b") and decision.reason == "tie"


def test_host_tier_blocks_are_priced_by_the_host_to_device_rate():
    policy = make_policy(CONFIG)
    blocks = prompt_blocks(3, num_blocks=100)
    host_view = idle("host", host_to_device_tokens_per_s=1600.0)  # slower than prefill
    decision = policy.choose(blocks, 1600, [host_view], {"host": Match(0, 100)})
    assert decision.predicted_ttft_s == pytest.approx(1.0)
    assert decision.matched_blocks == 100
    fast_host = idle("fast", host_to_device_tokens_per_s=160_000.0)
    decision = policy.choose(
        blocks,
        1600,
        [host_view, fast_host, idle("cold")],
        {"host": Match(0, 100), "fast": Match(0, 100)},
    )
    assert decision.replica_id == "fast"
    assert decision.predicted_ttft_s == pytest.approx(0.01)


def test_pulls_are_priced_only_when_configured_and_then_beat_a_queued_holder():
    """The holder's queue (0.34 s) beats a 2048-token prefill elsewhere (2 x 0.256 s), but not
    a pull of those tokens from it at 40000 tokens/s (0.0512 s); pulls off: unchanged."""
    blocks = prompt_blocks(5, num_blocks=128)
    holder = idle("holder", num_waiting=1, num_queued_prefill_tokens=2400)
    replicas = [holder, idle("cold")]
    matches = {"holder": Match(128, 0)}
    decision = make_policy(CONFIG).choose(blocks, 2048, replicas, matches)
    assert decision.replica_id == "holder" and decision.reason == "prefix"
    assert decision.predicted_ttft_s == pytest.approx(0.3 + 0.02 + 0.02)
    pulling = make_policy(dataclasses.replace(CONFIG, kv_pull_tokens_per_s=40_000.0))
    decision = pulling.choose(blocks, 2048, replicas, matches)
    assert decision.replica_id == "cold" and decision.matched_blocks == 0
    assert decision.predicted_ttft_s == pytest.approx(2048 / 40_000.0)
    # Host-tier blocks cannot be pulled: a peer holding the prefix only on its host prices
    # the cold replica as a full prefill again (a fresh policy: no earlier request of this
    # prefix lowers the price of a copy).
    fresh = make_policy(dataclasses.replace(CONFIG, kv_pull_tokens_per_s=40_000.0))
    decision = fresh.choose(blocks, 2048, replicas, {"holder": Match(0, 128)})
    assert decision.replica_id == "holder"


def test_peer_device_blocks_gives_each_holder_the_best_other_holder():
    matches = {"a": Match(10, 0), "b": Match(4, 9), "c": Match(4, 0)}
    assert peer_device_blocks(matches) == {"a": 4, "b": 10, "c": 10, "": 10}
    assert peer_device_blocks({}) == {"": 0}
    model = TTFTModel(dataclasses.replace(CONFIG, kv_pull_tokens_per_s=1600.0))
    # 4 local blocks (64 tokens), the peer holds 10 (160): 96 pulled, 40 of 200 computed.
    ttft_s = model.predicted_ttft_s(idle("b"), Match(4, 0), 200, 1.0, peer_blocks=10)
    assert ttft_s == pytest.approx(96 / 1600.0 + 40 / 8000.0)
    assert TTFTModel(CONFIG).predicted_ttft_s(idle("b"), Match(4, 0), 200, 1.0, 10) == (
        pytest.approx(136 / 8000.0)
    )


@pytest.mark.parametrize("rate", [0, -1.0, float("inf"), "fast"])
def test_kv_pull_rate_must_be_positive_or_none(rate):
    with pytest.raises(ValueError, match="kv_pull_tokens_per_s"):
        RouterConfig(kv_pull_tokens_per_s=rate)


def test_measured_rates_beat_defaults_and_a_replicas_requests_break_a_tie():
    policy = make_policy(CONFIG)
    blocks = prompt_blocks(4, num_blocks=64)
    fast = idle("fast", prefill_tokens_per_s=4 * CONFIG.default_prefill_tokens_per_s)
    decision = policy.choose(blocks, 1024, [idle("unmeasured"), fast], {})
    assert decision.replica_id == "fast"
    assert decision.predicted_ttft_s == pytest.approx(1024 / (4 * 8000.0))
    tied = [idle("x"), idle("y")]
    first = policy.choose(blocks, 1024, tied, {})
    loaded = [
        ReplicaView(
            v.replica_id, v.stats, ReplicaLoad(num_running=int(v.replica_id == first.replica_id))
        )
        for v in tied
    ]
    assert policy.choose(blocks, 1024, loaded, {}).replica_id != first.replica_id


def test_a_burst_of_cold_prompts_spreads_by_the_prefill_each_decision_queued():
    """The decisions of a burst see each other's prefill (the load counts a request from its
    decision on): a replica with a faster measured prefill rate takes one cold prompt, not
    the whole burst (7 of 8 went to one of three replicas when they counted only as decode
    steps)."""
    policy = make_policy(dataclasses.replace(CONFIG, max_load_ratio=None))
    rates = {"fast": 1500.0, "slow-1": 1000.0, "slow-2": 1000.0}
    sent: dict[str, list[int]] = {name: [] for name in rates}
    for first_token in range(6):
        views = [
            ReplicaView(
                name,
                ReplicaStats(prefill_tokens_per_s=rate),
                ReplicaLoad(num_queued=len(sent[name]), queued_prefill_tokens=sum(sent[name])),
            )
            for name, rate in rates.items()
        ]
        decision = policy.choose(prompt_blocks(first_token + 100, 32), 512, views, {})
        sent[decision.replica_id].append(512)
    counts = {name: len(tokens) for name, tokens in sent.items()}
    # Shares follow the rates (1.5 : 1 : 1 of 6 is 2.6 : 1.7 : 1.7); as decode steps only,
    # the fast replica took all 6.
    assert counts["fast"] <= 3 and min(counts.values()) >= 1, counts


def test_the_ttft_model_prices_the_queue_and_the_running_batch_of_the_load():
    """Queued requests cost their prefill tokens and one decode step each; a step costs the
    running requests at the measured decode rate; the stats' own counts play no part."""
    stats = ReplicaStats(
        num_running=7,  # the stats' counts are not the load: ignored
        num_queued_prefill_tokens=600,
        prefill_tokens_per_s=400.0,
        decode_tokens_per_s=40.0,
    )
    model = TTFTModel(CONFIG)
    view = ReplicaView(
        "a", stats, ReplicaLoad(num_queued=1, queued_prefill_tokens=80, num_running=2)
    )
    assert model.decode_step_s(view) == pytest.approx(2 / 40.0)
    assert model.queue_s(view) == pytest.approx(80 / 400.0 + 2 / 40.0)
    assert model.predicted_ttft_s(view, None, 40) == pytest.approx(
        80 / 400.0 + 2 / 40.0 + 40 / 400.0 + 2 / 40.0
    )
    idle_now = ReplicaView("a", stats, ReplicaLoad())
    assert model.decode_step_s(idle_now) == CONFIG.default_decode_step_s
    assert model.predicted_ttft_s(idle_now, None, 40) == pytest.approx(40 / 400.0)  # not busy


def test_a_prompt_that_does_not_fit_waits_for_running_requests_to_finish():
    """100 blocks, 80 held by 4 running requests (20 each), 10 queued ahead: 10 free. A request
    that needs more waits until enough of the 4 finish; they finish ``decode_s`` (10 s) after
    their first token, the k-th of 4 about k/5 of it from now."""
    stats = ReplicaStats(num_running=4, kv_usage=0.8, num_kv_blocks=100, decode_s=10.0)
    view = ReplicaView("a", stats, ReplicaLoad(num_queued=1, queued_prefill_tokens=160))
    model = TTFTModel(CONFIG)
    assert model.kv_wait_s(view, 10) == 0.0
    assert model.kv_wait_s(view, 11) == pytest.approx(10.0 * 1 / 5)  # one finish frees 20
    assert model.kv_wait_s(view, 50) == pytest.approx(10.0 * 2 / 5)  # 40 short: two
    assert model.kv_wait_s(view, 500) == pytest.approx(10.0 * 4 / 5)  # all four, at most
    # The blocks its device match covers need no slot: 16 of 20 matched leave 4.
    match = Match(device_blocks=16)
    without_wait = ReplicaView("a", dataclasses.replace(stats, decode_s=0.0), view.load)
    assert model.predicted_ttft_s(view, match, 20 * BLOCK_SIZE) == pytest.approx(
        model.predicted_ttft_s(without_wait, match, 20 * BLOCK_SIZE)
    )
    assert model.predicted_ttft_s(view, None, 20 * BLOCK_SIZE) == pytest.approx(
        model.predicted_ttft_s(without_wait, None, 20 * BLOCK_SIZE) + 10.0 * 1 / 5
    )
    # A replica that does not report its blocks, or has finished nothing yet: no wait.
    for unknown in (dataclasses.replace(stats, num_kv_blocks=0), ReplicaStats(num_running=4)):
        assert model.kv_wait_s(ReplicaView("a", unknown, view.load), 500) == 0.0


def test_a_holder_with_no_kv_space_loses_a_repeat_to_a_replica_with_room():
    """The holder has the prompt's first 10 of 16 blocks, the other 8; the holder's KV is full
    of running requests that run 20 s after their first token, so its 6 new blocks wait
    seconds there, far more than 2 blocks' prefill on the other. With room, the longer match
    wins."""
    policy = make_policy(CONFIG)
    blocks = prompt_blocks(3, num_blocks=16)
    full = ReplicaStats(num_running=2, kv_usage=1.0, num_kv_blocks=64, decode_s=20.0)
    roomy = dataclasses.replace(full, kv_usage=0.25)
    matches = {"holder": Match(device_blocks=10), "other": Match(device_blocks=8)}
    other = idle("other", **dataclasses.asdict(roomy))
    decision = policy.choose(
        blocks, 16 * BLOCK_SIZE, [idle("holder", **dataclasses.asdict(full)), other], matches
    )
    assert decision.replica_id == "other"
    with_room = [idle("holder", **dataclasses.asdict(roomy)), other]
    decision = policy.choose(blocks, 16 * BLOCK_SIZE, with_room, matches)
    assert (decision.replica_id, decision.reason) == ("holder", "prefix")


def test_least_loaded_reads_the_load_not_the_stats():
    """Both replicas reported 4 running a moment ago; since then one of a's finished. The
    load (3 running on a) decides, not the stats."""
    stats = ReplicaStats(num_running=4, decode_tokens_per_s=40.0)
    a = ReplicaView("a", stats, ReplicaLoad(num_running=3))
    b = ReplicaView("b", stats, ReplicaLoad(num_running=4))
    least = make_policy(RouterConfig(policy="least_loaded"))
    assert least.choose(prompt_blocks(5), 128, [b, a], {}).replica_id == "a"
    model = TTFTModel(CONFIG)
    assert model.decode_step_s(a) == pytest.approx(3 / 40.0)  # 3 running now, not 4
    assert model.decode_step_s(b) == pytest.approx(4 / 40.0)


def test_the_baselines_prefer_the_replica_with_less_prefill_queued_over_fewer_requests():
    """A new request's first token waits behind the prefills queued on its replica; running
    requests only lengthen each step: least loaded and pow2 put the queue first."""
    busy_decoding = ReplicaView("decoding", ReplicaStats(), ReplicaLoad(num_running=4))
    prefilling = ReplicaView(
        "prefilling", ReplicaStats(), ReplicaLoad(num_queued=1, queued_prefill_tokens=100)
    )
    replicas = [prefilling, busy_decoding]
    least = make_policy(RouterConfig(policy="least_loaded"))
    assert least.choose(prompt_blocks(5), 128, replicas, {}).replica_id == "decoding"
    pow2 = make_policy(RouterConfig(policy="pow2"))
    assert {pow2.choose(prompt_blocks(5), 128, replicas, {}).replica_id for _ in range(10)} == {
        "decoding"
    }


def test_baselines_behind_the_same_interface():
    replicas = [idle("a", num_running=2), idle("b"), idle("c", num_waiting=1)]
    blocks = prompt_blocks(5)
    round_robin = make_policy(RouterConfig(policy="round_robin"))
    picks = [round_robin.choose(blocks, 128, replicas, {}).replica_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    least = make_policy(RouterConfig(policy="least_loaded"))
    decision = least.choose(blocks, 128, replicas, {"b": Match(3)})
    assert (decision.replica_id, decision.matched_blocks, decision.reason) == (
        "b",
        3,
        RoutingReason.BASELINE,
    )
    pow2_a = make_policy(RouterConfig(policy="pow2", seed=7))
    pow2_b = make_policy(RouterConfig(policy="pow2", seed=7))
    seq_a = [pow2_a.choose(blocks, 128, replicas, {}).replica_id for _ in range(30)]
    seq_b = [pow2_b.choose(blocks, 128, replicas, {}).replica_id for _ in range(30)]
    assert seq_a == seq_b
    assert "a" not in seq_a  # the most loaded replica never wins a pair
    assert {p.name for p in (round_robin, least, pow2_a, make_policy(CONFIG))} == {
        "round_robin",
        "least_loaded",
        "pow2",
        "prefix",
    }


@pytest.mark.parametrize("name", ["prefix", "round_robin", "least_loaded", "pow2"])
def test_choose_rejects_an_empty_candidate_list(name):
    with pytest.raises(ValueError, match="replicas"):
        make_policy(RouterConfig(policy=name)).choose(prompt_blocks(0), 128, [], {})


def test_load_bound_spreads_a_hot_prefix_within_the_ratio():
    """One holder of a hot prefix, requests piling up (each still runs for the next few
    decisions): the holder keeps it until its recent count passes ``max_load_ratio`` x the
    mean + slack while it is busier than the others; then the prefix gets a second holder."""
    from router.prefix_policy import LOAD_BOUND_SLACK_REQUESTS

    policy = make_policy(CONFIG)
    blocks = prompt_blocks(6, num_blocks=64)
    ids = [f"r{i}" for i in range(4)]
    counts = collections.Counter()
    reasons = collections.Counter()
    holders = {"r0"}
    running: collections.deque[str] = collections.deque(maxlen=8)
    for _ in range(400):
        replicas = [idle(rid, num_running=running.count(rid)) for rid in ids]
        matches = {rid: Match(64) for rid in holders}
        decision = policy.choose(blocks, 1024, replicas, matches)
        counts[decision.replica_id] += 1
        reasons[decision.reason] += 1
        holders.add(decision.replica_id)  # the chosen replica caches the prefix
        running.append(decision.replica_id)
    mean = sum(counts.values()) / len(replicas)
    assert max(counts.values()) <= CONFIG.max_load_ratio * mean + LOAD_BOUND_SLACK_REQUESTS + 1
    assert len(holders) == 4  # replicated, not pinned to r0
    assert reasons[RoutingReason.LOAD_BOUND] > 0  # the spills are labelled as the bound's
    unbounded = make_policy(dataclasses.replace(CONFIG, max_load_ratio=None))
    picks = {
        unbounded.choose(blocks, 1024, replicas, {"r0": Match(64)}).replica_id for _ in range(50)
    }
    assert picks == {"r0"}  # without the bound the price alone keeps it on the holder


def test_a_replica_over_the_bound_still_wins_while_it_is_no_busier_than_the_others():
    """The recent counts see only this router's traffic (each ingress replica routes with its
    own): a replica far over the bound keeps its prefix while it holds no more requests than
    the others right now (nothing piles up there), and loses it once it is the busier one."""
    policy = make_policy(CONFIG)
    blocks = prompt_blocks(7, num_blocks=64)
    quiet = [idle("a"), idle("b")]
    for _ in range(20):  # "a" takes everything: far over the bound of this router's counts
        policy.choose(blocks, 1024, [quiet[0]], {})
    busy_b = [idle("a"), idle("b", num_waiting=4)]  # other routers' traffic loads "b"
    assert policy.choose(blocks, 1024, busy_b, {"a": Match(64)}).replica_id == "a"
    assert policy.choose(blocks, 1024, quiet, {"a": Match(64)}).replica_id == "a"
    busy_a = [idle("a", num_running=2), idle("b")]
    decision = policy.choose(blocks, 1024, busy_a, {"a": Match(64)})
    assert decision.replica_id == "b" and decision.reason == RoutingReason.LOAD_BOUND


def test_a_prefix_seen_often_earns_a_copy_when_its_holder_queues():
    """The holder has 200 tokens queued (0.24 s at 1000 tokens/s with the decode steps); a
    copy of the 512-token prefix on the idle replica costs 2 x 0.512 s. A prefix this router
    has not seen stays with its holder; after 30 requests of it (shared by 2 holders once
    copied: 15 each) a copy that fits in empty blocks is charged 1/16 of its price (0.064 s)
    and wins, and so does one on a replica whose cache keeps unused blocks for a whole window
    (``kv_lru_age`` >= ``load_window_per_replica``); on a replica whose cache keeps them for 4
    of its requests (a reuse of about 16 x 4/64 = 1: half the price, 0.512 s) it does not.
    The reported TTFT is the copy's real one. The load bound is off: only the price decides."""
    config = dataclasses.replace(CONFIG, max_load_ratio=None)
    blocks = prompt_blocks(11, num_blocks=32)
    rate = {"prefill_tokens_per_s": 1000.0}
    queued = idle("holder", num_waiting=1, num_queued_prefill_tokens=200, **rate)
    roomy = idle("cold", num_empty_kv_blocks=32, **rate)
    matches = {"holder": Match(32)}
    fresh = make_policy(config)
    decision = fresh.choose(blocks, 512, [queued, roomy], matches)
    assert (decision.replica_id, decision.reason) == ("holder", "prefix")

    seen = make_policy(config)
    for _ in range(30):
        decision = seen.choose(blocks, 512, [idle("holder", **rate), roomy], matches)
        assert decision.replica_id == "holder"
    decision = seen.choose(blocks, 512, [queued, roomy], matches)
    assert (decision.replica_id, decision.reason) == ("cold", "shortest_queue")
    assert decision.predicted_ttft_s == pytest.approx(0.512)
    keeps_long = idle("cold", num_empty_kv_blocks=31, kv_lru_age=64, **rate)
    assert seen.choose(blocks, 512, [queued, keeps_long], matches).replica_id == "cold"
    evicts_soon = idle("cold", num_empty_kv_blocks=31, kv_lru_age=4, **rate)
    assert seen.choose(blocks, 512, [queued, evicts_soon], matches).replica_id == "holder"
    # With copy pricing off the same history buys no copy: the whole prefill is charged.
    no_copies = make_policy(dataclasses.replace(config, copy_pricing=False))
    for _ in range(30):
        no_copies.choose(blocks, 512, [idle("holder", **rate), roomy], matches)
    assert no_copies.choose(blocks, 512, [queued, roomy], matches).replica_id == "holder"
    # Once both hold it, neither is a copy: the queue decides alone.
    both = {"holder": Match(32), "cold": Match(32)}
    busy_cold = idle("cold", num_waiting=1, num_queued_prefill_tokens=300, **rate)
    decision = seen.choose(blocks, 512, [queued, busy_cold], both)
    assert decision.replica_id == "holder"
