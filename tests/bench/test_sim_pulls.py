"""The simulator's KV pulls between replicas and its in-flight prefix dedup, on hand-checked
cases (times below follow from the round rates), the block pools' pins on a random workload,
and the ``kv_pull`` calibration section."""

import json

import pytest

from bench.sim import report
from bench.sim.baselines import RandomPolicy
from bench.sim.calibration import (
    CALIBRATION_PATH,
    PullRates,
    load_pull_rates,
    record_rates,
)
from bench.sim.ours import OursPolicy
from bench.sim.simulator import SimConfig, Simulator
from bench.sim.workloads import Request, Workload, WorkloadScale, llmd_shared_prefix
from tests.bench.sim_helpers import HAND_RATES as RATES

PULL = PullRates(kv_bytes_per_token=10.0, pull_bytes_per_s=1200.0, source="test")  # 120 tok/s


class ByRequest:
    """Sends request i to replica ``placement[i]``."""

    name = "by_request"

    def __init__(self, placement):
        self.placement = placement

    def choose(self, sim, req):
        return self.placement[req.request_id]


def _sim(placement, pull=PULL, num_replicas=2):
    # The hand-checked timelines below follow arrival order (prefill_order="fcfs").
    config = SimConfig(num_replicas, 64, block_size=4, rates=RATES, pull=pull, prefill_order="fcfs")
    return Simulator(config, ByRequest(placement))


def _run(requests, placement, pull=PULL):
    sim = _sim(placement, pull)
    return sim, sim.run(Workload("hand", tuple(requests), "hand-checked"))


def _req(i, at_s, num_tokens=13):
    return Request(i, at_s, (1, 2, 3), num_prompt_tokens=num_tokens, num_output_tokens=2)


def test_pull_rate_is_bytes_over_bandwidth():
    assert PULL.pull_tokens_per_s == pytest.approx(120.0)
    assert PULL.pull_s(12) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="pull_bytes_per_s"):
        PullRates(kv_bytes_per_token=1.0, pull_bytes_per_s=0.0, source="x")


def test_a_replica_lacking_a_prefix_a_peer_holds_pulls_it_instead_of_prefilling():
    a, b = _req(0, 0.0, 12), _req(1, 10.0)
    _, pulled = _run([a, b], [0, 1])
    # a: 12 tokens computed (0.12 s). b on replica 1: 12 tokens pulled (0.1 s), 1 computed.
    assert pulled.ttft_mean_s == pytest.approx((0.12 + 0.11) / 2)
    assert pulled.hit_rate == pytest.approx(12 / 25)
    assert pulled.pulled_token_rate == pytest.approx(12 / 25)
    _, computed = _run([a, b], [0, 1], pull=None)
    assert computed.hit_rate == 0.0 and computed.pulled_token_rate == 0.0
    assert computed.ttft_mean_s == pytest.approx((0.12 + 0.13) / 2)


def test_a_request_waits_for_a_pull_in_flight_on_its_replica_instead_of_pulling_again():
    a, b, c = _req(0, 0.0, 12), _req(1, 10.0), _req(2, 10.05)
    sim, result = _run([a, b, c], [0, 1, 1])
    # b pulls 10.0-10.1; c's next block is in flight, so it waits (no second pull, no
    # prefill) and, ahead of b in the prefill queue, computes 1 token at 10.1-10.11; then b
    # (1 token, sharing a step with c's decode) 10.11-10.13.
    assert result.pulled_token_rate == pytest.approx(12 / 38)
    assert result.hit_rate == pytest.approx(24 / 38)
    assert sim.num_dedup_deferrals >= 1
    assert result.num_dedup_deferrals == sim.num_dedup_deferrals
    assert result.ttft_p50_s == pytest.approx(0.12)
    assert result.ttft_mean_s == pytest.approx((0.12 + 0.13 + 0.06) / 3)


def test_a_request_waits_for_the_peer_computing_its_prefix_then_pulls_it():
    a, b = _req(0, 0.0, 12), _req(1, 0.05)
    sim, result = _run([a, b], [0, 1])
    # a computes 0-0.12 on replica 0; b waits on replica 1, pulls 0.12-0.22, computes 1 token.
    assert result.hit_rate == pytest.approx(12 / 25)
    assert result.ttft_mean_s == pytest.approx((0.12 + 0.23 - 0.05) / 2)
    assert sim.num_dedup_deferrals == 1
    _, alone = _run([a, b], [0, 1], pull=None)  # without pulls each replica computes its own
    assert alone.hit_rate == 0.0 and alone.ttft_mean_s == pytest.approx((0.12 + 0.13) / 2)


@pytest.mark.parametrize("make_policy", [RandomPolicy, OursPolicy])
def test_pools_end_with_no_pins_and_no_reservations(make_policy):
    scale = WorkloadScale(
        num_replicas=4,
        capacity_blocks=96,
        requests_per_replica=12,
        offered_load=1.0,
        prefill_tokens_per_s=RATES.prefill_tokens_per_s,
    )
    workload = llmd_shared_prefix(scale)
    config = SimConfig(4, 96, rates=RATES, pull=PULL)
    sim = Simulator(config, make_policy())
    result = sim.run(workload)
    assert 0 < result.pulled_token_rate <= result.hit_rate <= result.oracle_hit_rate + 1e-9
    for replica in sim.replicas:
        assert not replica.cache.pinned and replica.cache.num_reserved_blocks == 0
        assert not replica.in_flight and not replica.pull_queue and not replica.pull_pins
    assert not sim.computing and not sim.waiters


def test_calibration_kv_pull_section_is_loaded_and_kept_by_record_rates(tmp_path):
    shipped = load_pull_rates(CALIBRATION_PATH)
    assert shipped is not None and shipped.pull_tokens_per_s > 0 and shipped.source
    path = tmp_path / "calibration.json"
    assert load_pull_rates(path) is None
    path.write_text(
        json.dumps(
            {
                "rates": {},
                "kv_pull": {"kv_bytes_per_token": 8.0, "pull_bytes_per_s": 80.0, "source": "t"},
            }
        )
    )
    record_rates(RATES, path)
    assert load_pull_rates(path) == PullRates(8.0, 80.0, "t")
    path.write_text(json.dumps({"kv_pull": {"kv_bytes_per_token": 8.0}}))
    with pytest.raises(ValueError, match="kv_pull"):
        load_pull_rates(path)


def test_summary_ranks_ours_p90_with_ties_within_one_percent():
    def row(policy, p90, workload="w"):
        return {
            "workload": workload,
            "replicas": 8,
            "policy": policy,
            "ttft_p90_s": p90,
            "hit_rate": 0.45,
            "oracle_hit_rate": 0.5,
            "max_mean_load": 1.1,
        }

    rows = [
        row("a", 1.0),
        row("b", 2.0),
        row("prefix", 1.005),
        row("a", 1.0, "v"),
        row("prefix", 1.5, "v"),
    ]
    summary = {s["workload"]: s for s in report.ours_summary(rows)}
    assert summary["w"]["p90_rank"] == 1 and summary["w"]["num_policies"] == 3
    assert summary["v"]["p90_rank"] == 2
    assert summary["w"]["hit_of_oracle"] == pytest.approx(0.9)
    assert "| w | 8 | 90.0% | - | - | 1.10 | 1 of 3 |" in report.summary_table(summary.values())


def test_prefix_prices_pulls_at_the_chosen_factor_of_the_transfer_time():
    from bench.sim.ours import PULL_PRICE_FACTOR

    sim = Simulator(SimConfig(2, 64, block_size=4, rates=RATES, pull=PULL), RandomPolicy())
    default, tuned = OursPolicy(), OursPolicy(pull_price_factor=4.0)
    default._setup(sim)
    tuned._setup(sim)
    assert default.router_config.kv_pull_tokens_per_s == pytest.approx(120.0 / PULL_PRICE_FACTOR)
    assert tuned.router_config.kv_pull_tokens_per_s == pytest.approx(30.0)
    no_pulls = OursPolicy(pull_price_factor=4.0)
    no_pulls._setup(Simulator(SimConfig(2, 64, block_size=4, rates=RATES), RandomPolicy()))
    assert no_pulls.router_config.kv_pull_tokens_per_s is None
