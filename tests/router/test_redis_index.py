"""What only the Redis backend promises: namespaced keys, bounded memory, fast failure."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
import redis

from bench.common import free_port
from router.config import RouterConfig
from router.index import FallbackIndex, make_index
from router.index_types import IndexUnavailableError, Match
from router.protocol import EventKind, KVEvent, KVEventBatch
from router.redis_index import RedisIndex
from tests.router.helpers import batch, chain, stored

pytestmark = pytest.mark.redis


def _all_keys(url: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(count=1000))
    finally:
        client.close()


def test_keys_are_namespaced_per_model_and_version_and_hold_no_prompt_text(redis_url, clock):
    index = RedisIndex(redis_url, "ns-model-a", clock=clock)
    other = RedisIndex(redis_url, "ns-model-b", clock=clock)
    blocks = chain(4)
    for idx in (index, other):
        idx.heartbeat("r0", 0)
    index.apply(batch("r0", 0, stored(blocks)))
    assert other.match(blocks) == {}
    assert index.match(blocks) == {"r0": Match(4, 0)}
    client = redis.Redis.from_url(redis_url)
    keys = [k for k in _all_keys(redis_url) if b"ns-model-a" in k]
    assert keys and all(k.startswith(b"prefixserve:v1:ns-model-a:") for k in keys)
    members = client.smembers(b"prefixserve:v1:ns-model-a:dev:r0")
    assert members == set(blocks)  # the 16-byte hashes, nothing of the tokens
    assert all(len(m) == 16 for m in members)
    # Every key expires by itself if no router is left to sweep it.
    assert all(0 < client.pttl(k) <= 30_000 for k in keys)
    client.close()


def test_sweep_deletes_a_dead_replicas_keys(redis_url, clock):
    index = RedisIndex(redis_url, "sweep-model", heartbeat_timeout_s=2.0, clock=clock)
    blocks = chain(3)
    index.heartbeat("dead", 0)
    index.apply(batch("dead", 0, stored(blocks)))
    index.record_speculative("dead", chain(2, first_token=99), ttl_s=5.0)
    clock.advance(3.0)
    index.heartbeat("alive", 0)  # heartbeats sweep
    keys = [k for k in _all_keys(redis_url) if k.startswith(b"prefixserve:v1:sweep-model:")]
    assert not [k for k in keys if k.endswith(b":dead")]
    assert index.replicas() == ["alive"]


def test_unreachable_redis_raises_index_unavailable_quickly(clock):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    index = RedisIndex(url, "m", socket_timeout_s=0.05, clock=clock)
    start_s = time.monotonic()
    for call in (
        lambda: index.match(chain(2)),
        lambda: index.heartbeat("a", 0),
        lambda: index.apply(batch("a", 0, stored(chain(1)))),
        lambda: index.record_speculative("a", chain(1), 1.0),
        index.replicas,
    ):
        with pytest.raises(IndexUnavailableError):
            call()
    assert time.monotonic() - start_s < 2.0


class _NoThreads(concurrent.futures.ThreadPoolExecutor):
    def submit(self, fn, /, *args, **kwargs):
        raise AssertionError("a lookup went to a worker thread")


def _on_a_loop_without_threads(coro_fn):
    """Runs ``coro_fn()`` on a fresh loop whose default executor refuses work."""

    async def main():
        asyncio.get_running_loop().set_default_executor(_NoThreads())
        return await coro_fn()

    return asyncio.run(main())


def test_an_async_lookup_answers_as_the_sync_one_without_a_thread(redis_url, clock):
    index = RedisIndex(redis_url, "async-model", clock=clock)
    fallback = FallbackIndex(index, retry_interval_s=1.0)
    blocks = chain(6)
    for replica, held in (("a", 6), ("b", 2)):
        index.heartbeat(replica, 0)
        index.apply(batch(replica, 0, stored(blocks[:held])))
    expected = {"a": Match(6, 0), "b": Match(2, 0)}
    assert index.match(blocks) == expected
    # Two loops one after the other: each gets its own asyncio client.
    for _ in range(2):
        assert _on_a_loop_without_threads(lambda: fallback.match_or_none_async(blocks)) == expected
    assert _on_a_loop_without_threads(lambda: index.match_async([])) == {}
    index.close()


def test_an_unreachable_redis_fails_an_async_lookup_quickly(clock):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    index = RedisIndex(url, "m", socket_timeout_s=0.05, clock=clock)
    fallback = FallbackIndex(index, retry_interval_s=60.0)
    start_s = time.monotonic()
    with pytest.raises(IndexUnavailableError, match="redis at"):
        _on_a_loop_without_threads(lambda: index.match_async(chain(2)))
    assert _on_a_loop_without_threads(lambda: fallback.match_or_none_async(chain(2))) is None
    assert not fallback.available
    assert time.monotonic() - start_s < 2.0


def test_large_batches_and_long_prompts_cross_the_chunk_limits(redis_url, clock):
    index = RedisIndex(redis_url, "big-model", clock=clock)
    blocks = chain(2500)  # 40k tokens: beyond one SADD chunk and Lua's unpack limit
    index.heartbeat("a", 0)
    index.apply(KVEventBatch("a", 0, (KVEvent(EventKind.STORED, tuple(blocks[:2100])),)))
    assert index.match(blocks) == {"a": Match(2100, 0)}


def test_make_index_builds_the_configured_backend(redis_url):
    config = RouterConfig(index_backend="redis", redis_url=redis_url)
    index = make_index(config, "factory-model")
    assert isinstance(index, RedisIndex)
    assert index.prefix == "prefixserve:v1:factory-model:"
    index.close()


@pytest.mark.redis
def test_password_comes_from_the_environment_when_the_url_has_none(tmp_path, clock, monkeypatch):
    from tests.router.conftest import RedisServer

    server = RedisServer(str(tmp_path))
    server.start()
    try:
        redis.Redis(host="127.0.0.1", port=server.port).config_set("requirepass", "s3cret")
        monkeypatch.delenv("PREFIXSERVE_REDIS_PASSWORD", raising=False)
        with pytest.raises(IndexUnavailableError):
            RedisIndex(server.url, "auth-model", clock=clock).match(chain(2))
        monkeypatch.setenv("PREFIXSERVE_REDIS_PASSWORD", "s3cret")
        index = RedisIndex(server.url, "auth-model", clock=clock)
        index.apply(batch("r0", 0, stored(chain(2))))
        assert index.match(chain(2))["r0"] == Match(device_blocks=2)
    finally:
        server.stop()
