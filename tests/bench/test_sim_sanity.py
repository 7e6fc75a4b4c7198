"""Sanity of the simulator's rankings on llm-d's 73%-capacity workload at a small scale, and
of the adapter that runs our own policy (``router.policy``) inside it. Each case takes ~1 s."""

import functools

import pytest

from bench.sim.baselines import LlmdPrecisePolicy, RandomPolicy, SGLangCacheAwarePolicy
from bench.sim.ours import OursPolicy
from bench.sim.simulator import SimConfig, Simulator
from bench.sim.workloads import WorkloadScale, llmd_shared_prefix

NUM_REPLICAS, CAPACITY_BLOCKS = 16, 512


@functools.cache
def _p90(policy_name: str) -> float:
    policies = {
        "random": RandomPolicy,
        "sglang": SGLangCacheAwarePolicy,
        "llmd": LlmdPrecisePolicy,
        "prefix": OursPolicy,
    }
    scale = WorkloadScale(NUM_REPLICAS, CAPACITY_BLOCKS, requests_per_replica=30, seed=1)
    config = SimConfig(NUM_REPLICAS, CAPACITY_BLOCKS, seed=1)
    return Simulator(config, policies[policy_name]()).run(llmd_shared_prefix(scale)).ttft_p90_s


def test_cache_aware_policies_beat_random_on_p90_ttft():
    assert _p90("llmd") < _p90("random") / 2
    assert _p90("sglang") < _p90("random") / 2


@pytest.mark.xfail(
    strict=True,
    reason="llm-d's table ranks precise above approximate; in this model SGLang's approximate "
    "tree keeps every group on one replica with no cache pressure, while the precise scorer's "
    "index lags by one prefill (KV events) and trades hits for queue balance",
)
def test_precise_beats_approximate_as_llmd_published():
    assert _p90("llmd") < _p90("sglang")


def test_our_policy_runs_through_the_adapter_and_beats_random():
    assert _p90("prefix") < _p90("random") / 2
