"""RouterConfig validation: bad values fail at construction, naming the field."""

from __future__ import annotations

import pickle

import pytest

from router.config import RouterConfig


def test_defaults_are_valid_frozen_and_picklable():
    config = RouterConfig()
    assert (config.policy, config.index_backend, config.block_size) == ("prefix", "embedded", 16)
    with pytest.raises(AttributeError):
        config.policy = "pow2"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(config)) == config


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy": "random"}, "policy"),
        ({"index_backend": "memcached"}, "index_backend"),
        ({"index_backend": "redis"}, "redis_url"),
        ({"redis_url": "http://localhost:6379"}, "redis_url"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 16.0}, "block_size"),
        ({"default_prefill_tokens_per_s": 0.0}, "default_prefill_tokens_per_s"),
        ({"default_decode_step_s": -1.0}, "default_decode_step_s"),
        ({"default_host_to_device_tokens_per_s": float("inf")}, "default_host_to_device"),
        ({"speculative_ttl_s": 0}, "speculative_ttl_s"),
        ({"heartbeat_timeout_s": float("nan")}, "heartbeat_timeout_s"),
        ({"redis_socket_timeout_s": "fast"}, "redis_socket_timeout_s"),
        ({"redis_retry_interval_s": 0}, "redis_retry_interval_s"),
        ({"redis_write_timeout_s": -2}, "redis_write_timeout_s"),
        ({"tie_tolerance_s": -0.1}, "tie_tolerance_s"),
        ({"max_load_ratio": 0.9}, "max_load_ratio"),
        ({"load_window_per_replica": 0}, "load_window_per_replica"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kwargs)


def test_redis_backend_with_url():
    config = RouterConfig(index_backend="redis", redis_url="redis://127.0.0.1:1/0")
    assert config.redis_url == "redis://127.0.0.1:1/0"
