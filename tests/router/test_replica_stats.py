"""``ReplicaStats`` as it travels in Serve's routing stats: every field survives the round trip,
and a payload from an older replica (fewer fields) or a newer one (more) still parses."""

from __future__ import annotations

import dataclasses

import pytest

from router.protocol import ReplicaStats


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_every_field_survives_the_round_trip(kv_cache_dtype):
    stats = ReplicaStats(
        num_waiting=3,
        num_running=2,
        kv_usage=0.5,
        prefill_tokens_per_s=900.0,
        decode_tokens_per_s=40.0,
        num_queued_prefill_tokens=128,
        host_to_device_tokens_per_s=8000.0,
        as_of_s=1700000000.25,
        engine_alive=False,
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=512,
        decode_s=3.5,
    )
    data = stats.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(ReplicaStats)}
    assert data["kv_cache_dtype"] == kv_cache_dtype
    assert ReplicaStats.from_dict(data) == stats


def test_the_default_is_the_models_dtype():
    assert ReplicaStats().kv_cache_dtype == "auto"
    assert ReplicaStats().to_dict()["kv_cache_dtype"] == "auto"


def test_a_payload_without_the_field_reads_as_auto():
    """A replica of an older version reports no ``kv_cache_dtype``."""
    old = ReplicaStats(num_waiting=1, kv_usage=0.25).to_dict()
    del old["kv_cache_dtype"]
    stats = ReplicaStats.from_dict(old)
    assert stats.kv_cache_dtype == "auto"
    assert (stats.num_waiting, stats.kv_usage) == (1, 0.25)


def test_keys_the_stats_do_not_know_are_ignored():
    """The replica adds ``model_id`` beside the stats; a newer replica may add more."""
    data = {**ReplicaStats(kv_cache_dtype="int8").to_dict(), "model_id": "m", "future": 1}
    assert ReplicaStats.from_dict(data) == ReplicaStats(kv_cache_dtype="int8")
    assert ReplicaStats.from_dict({}) == ReplicaStats()
