"""The simulator's event order, hit accounting and metrics on hand-checked cases, its exact
index against a brute-force scan, and workload reproducibility."""

import pytest

from bench.common import percentile
from bench.sim.baselines import RandomPolicy, RoundRobinPolicy
from bench.sim.calibration import rates_from_samples
from bench.sim.ours import OursPolicy
from bench.sim.simulator import SimConfig, Simulator
from bench.sim.workloads import WORKLOADS, Request, Workload, WorkloadScale, llmd_shared_prefix
from tests.bench.sim_helpers import HAND_RATES as RATES
from tests.bench.sim_helpers import FirstReplica


def _run(requests, policy=None, num_replicas=1, capacity_blocks=64, prefill_order="fcfs"):
    config = SimConfig(
        num_replicas, capacity_blocks, block_size=4, rates=RATES, prefill_order=prefill_order
    )
    workload = Workload("hand", tuple(requests), "hand-checked")
    return Simulator(config, policy or FirstReplica()).run(workload)


def test_second_request_hits_the_prefix_the_first_one_computed():
    a = Request(0, 0.0, (1, 2, 3), num_prompt_tokens=12, num_output_tokens=2)
    b = Request(1, 10.0, (1, 2, 3), num_prompt_tokens=13, num_output_tokens=2)
    result = _run([a, b])
    # a: 12 uncached tokens at 100 tok/s; b: 12 cached, 1 computed.
    assert result.ttft_p50_s == pytest.approx((0.12 + 0.01) / 2)
    assert result.hit_rate == pytest.approx(12 / 25)
    assert result.oracle_hit_rate == pytest.approx(12 / 25)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    a = Request(0, 0.0, (1, 2), 8, 1)
    b = Request(1, 5.0, (1, 2), 8, 1)
    result = _run([a, b])
    assert result.hit_rate == pytest.approx(7 / 16)  # b reuses 7 of its 8 tokens


def test_prefills_queue_in_arrival_order_and_share_steps_with_running_decodes():
    a = Request(0, 0.0, (1, 2, 3, 4, 5), 20, 11)  # prefill 0.2 s, then 10 decode steps
    b = Request(1, 0.05, (9, 8), 8, 2)  # waits for a's prefill
    result = _run([a, b])
    ttft_b = (0.2 + 0.08 + 0.01) - 0.05  # starts at 0.2, 8 tokens + one shared decode step
    assert result.ttft_p50_s == pytest.approx((0.2 + ttft_b) / 2)
    assert result.ttft_p99_s == pytest.approx(0.2 + (ttft_b - 0.2) * 0.99)


def test_a_prefill_that_finds_the_server_idle_waits_out_the_decode_step_under_way():
    a = Request(0, 0.0, (1, 2, 3, 4, 5), 20, 101)  # prefill 0.2 s, then decodes until ~1.2 s
    b = Request(1, 0.5, (9, 8), 8, 2)  # arrives mid-decode, the prefill server idle
    result = _run([a, b])
    ttft_b = 2 * result.ttft_p50_s - 0.2
    # 8 tokens and one shared decode step (0.09 s), after up to one step (0.01 s) of waiting.
    assert 0.09 + 1e-6 < ttft_b < 0.10


def test_shortest_first_starts_a_mostly_cached_prompt_before_a_cold_one_queued_earlier():
    warm = Request(0, 0.0, (1, 2, 3, 4, 5), 20, 1)  # 0.2 s, caches blocks 1-5
    running = Request(1, 1.0, (7, 8), 8, 1)  # 0.08 s: the server is busy when the others come
    cold = Request(2, 1.01, (9, 10, 11, 12, 13), 20, 1)  # 0.2 s
    hit = Request(3, 1.02, (1, 2, 3, 4, 5, 6), 22, 1)  # 20 cached: 0.02 s
    ttft = {}
    for order in ("fcfs", "shortest_first"):
        result = _run([warm, running, cold, hit], prefill_order=order)
        ttft[order] = result.ttft_mean_s * 4 - 0.2 - 0.08  # cold's TTFT + hit's
    # Each starts with one request in decode: its prefill shares one 0.01 s step. fcfs: cold
    # starts at 1.08 (TTFT 0.28), hit at 1.29 (0.30); shortest_first: hit at 1.08 (0.09),
    # then cold at 1.11 (0.31).
    assert ttft["fcfs"] == pytest.approx(0.28 + 0.30)
    assert ttft["shortest_first"] == pytest.approx(0.09 + 0.31)


def test_a_request_queued_behind_its_prefix_hits_it():
    a = Request(0, 0.0, (1, 2, 3), 12, 2)
    b = Request(1, 0.01, (1, 2, 3, 4), 16, 2)  # arrives while a is still prefilling
    result = _run([a, b])
    assert result.hit_rate == pytest.approx(12 / 28)


def test_load_and_throughput_metrics():
    requests = [Request(i, i * 10.0, (100 + i,), 4, 2) for i in range(4)]
    result = _run(requests, RoundRobinPolicy(), num_replicas=2)
    assert result.max_mean_load == pytest.approx(1.0)
    span_s = 30.0 + 0.04 + 0.01  # last arrival + its prefill + one decode step
    assert result.throughput_tok_s == pytest.approx(4 * 6 / span_s)


def test_exact_index_matches_a_brute_force_scan_of_every_replica():
    class Checked(RandomPolicy):
        def choose(self, sim, req):
            brute = {}
            for replica in sim.replicas:
                device, host = replica.cache.match(req.block_ids)
                if device + host:
                    brute[replica.index] = (device, host)
            assert sim.exact_matches(req.block_ids) == brute
            return super().choose(sim, req)

    for make in WORKLOADS.values():
        scale = WorkloadScale(8, 128, requests_per_replica=15, seed=3)
        Simulator(SimConfig(8, 128), Checked()).run(make(scale))


def test_workloads_are_reproducible_and_sized_to_the_cluster():
    scale = WorkloadScale(16, 256, requests_per_replica=10, seed=7)
    for make in WORKLOADS.values():
        assert make(scale) == make(scale)
        assert len(make(scale).requests) == 160
    wl = llmd_shared_prefix(scale)
    distinct = {b for r in wl.requests for b in r.block_ids}
    assert len(distinct) <= 0.73 * 16 * 256 * 1.01


def test_percentile_and_calibration_fit():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    rates = rates_from_samples(1000.0, [(1, 0.02), (3, 0.03), (5, 0.04)])
    assert rates.decode_step_base_s == pytest.approx(0.02)
    assert rates.decode_step_s(5) == pytest.approx(0.04)
    with pytest.raises(ValueError, match="decode_samples"):
        rates_from_samples(1000.0, [])


def test_invalid_sizes_name_the_field():
    with pytest.raises(ValueError, match="num_replicas"):
        SimConfig(0, 10)
    with pytest.raises(ValueError, match="offered_load"):
        WorkloadScale(4, 10, offered_load=0)


def test_recorded_rates_round_trip_and_a_malformed_file_is_an_error(tmp_path):
    from bench.sim.calibration import DEFAULT_RATES, load_rates, record_rates

    path = tmp_path / "calibration.json"
    assert load_rates(path) == DEFAULT_RATES  # no file yet: the labelled defaults
    record_rates(RATES, path, note="test")
    assert load_rates(path) == RATES
    path.write_text('{"rates": {"prefill_tokens_per_s": 1}}')
    with pytest.raises(ValueError, match="malformed"):
        load_rates(path)


def test_a_host_tier_raises_the_hit_rate_of_a_cache_starved_cluster():
    from bench.sim.workloads import zipf_prefixes

    scale = WorkloadScale(4, 96, requests_per_replica=40, seed=2)
    workload = zipf_prefixes(scale)
    device_only = Simulator(SimConfig(4, 96, seed=2), RoundRobinPolicy()).run(workload)
    with_host = Simulator(
        SimConfig(4, 96, host_capacity_blocks=2048, seed=2), RoundRobinPolicy()
    ).run(workload)
    assert with_host.hit_rate > device_only.hit_rate + 0.1
    assert with_host.oracle_hit_rate == device_only.oracle_hit_rate


def test_simulated_baselines_are_the_routers_and_break_ties_alike():
    """``bench.sim.baselines`` runs ``router.baselines`` on the simulator's views: the same
    choices as the deployed policy given the same views, seed and first block."""
    from bench.sim.baselines import LeastLoadedPolicy, PowerOfTwoPolicy
    from bench.sim.ours import SimViews, block_hashes
    from router.config import RouterConfig
    from router.policies import make_policy

    requests = [Request(i, i * 0.001, (500 + i, 7), 8, 4) for i in range(24)]
    for sim_policy in (RoundRobinPolicy(), LeastLoadedPolicy(), PowerOfTwoPolicy()):
        config = SimConfig(3, 64, block_size=4, rates=RATES, seed=5)
        deployed = make_policy(RouterConfig(policy=sim_policy.name, block_size=4, seed=5))
        sim = Simulator(config, sim_policy)
        views, mismatches = SimViews(sim), []
        original = sim_policy.choose

        def checked(
            s, req, original=original, deployed=deployed, views=views, mismatches=mismatches
        ):
            chosen = original(s, req)
            expected = deployed.choose(
                block_hashes(req.block_ids[:1]), req.num_prompt_tokens, views.all(s), {}
            )
            if s.replicas[chosen].replica_id != expected.replica_id:
                mismatches.append(req.request_id)
            return chosen

        sim_policy.choose = checked
        result = sim.run(Workload("hand", tuple(requests), "hand-checked"))
        assert result.policy == sim_policy.name and not mismatches


def test_copied_block_share_counts_each_copy_beyond_the_first_at_every_arrival():
    # Round robin over 2 replicas, requests 10 s apart (each done long before the next):
    # at a's arrival nothing is stored (0), at b's r0 holds (1, 2) (0 copies), at c's r0 and
    # r1 both hold them: 4 stored, 2 distinct (half are copies).
    a, b, c = (Request(i, i * 10.0, (1, 2), 8, 1) for i in range(3))
    result = _run([a, b, c], RoundRobinPolicy(), num_replicas=2)
    assert result.copied_block_share == pytest.approx((0 + 0 + 0.5) / 3)
    # One replica never copies.
    assert _run([a, b, c]).copied_block_share == 0.0


def test_pooled_reference_is_the_oracle_with_the_clusters_capacity():
    # Two replicas of 2 blocks each: the pooled cache holds 4 blocks.
    a = Request(0, 0.0, (1, 2), 8, 1)
    b = Request(1, 1.0, (3, 4), 8, 1)
    c = Request(2, 2.0, (1, 2), 8, 1)  # 2 blocks seen since: still in a 4-block cache
    d = Request(3, 3.0, (5, 6, 7), 12, 1)  # evicts the 3 least recent blocks: 4, 3 and 2
    e = Request(4, 4.0, (1, 2), 8, 1)  # the pooled cache still holds its head block only
    result = _run([a, b, c, d, e], RoundRobinPolicy(), num_replicas=2, capacity_blocks=2)
    prompt_tokens = 8 * 4 + 12
    assert result.oracle_hit_rate == pytest.approx((7 + 7) / prompt_tokens)  # c and e
    assert result.pooled_hit_rate == pytest.approx((7 + 4) / prompt_tokens)
    assert result.hit_rate <= result.oracle_hit_rate


def test_several_routers_take_the_requests_in_turn_each_with_its_own_counts():
    policy = OursPolicy(num_routers=2)
    sim = Simulator(SimConfig(2, 64, block_size=4, rates=RATES), policy)
    policy._setup(sim)
    dealt = []
    for i, router in enumerate(policy._policies):
        choose = router.choose

        def recording(*args, _i=i, _choose=choose, **kwargs):
            dealt.append(_i)
            return _choose(*args, **kwargs)

        router.choose = recording
    requests = tuple(Request(i, 0.01 * i, (i + 1, i + 2), 8, 2) for i in range(5))
    sim.run(Workload("turns", requests, "five requests"))
    assert dealt == [0, 1, 0, 1, 0]
    first, second = (router._recent for router in policy._policies)
    assert first is not second
    with pytest.raises(ValueError, match="num_routers"):
        OursPolicy(num_routers=0)
