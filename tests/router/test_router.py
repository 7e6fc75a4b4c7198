"""Router = index + policy + speculative entries + metrics, over both backends and through
a Redis outage."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from router.config import RouterConfig
from router.embedded_index import EmbeddedIndex
from router.index import FallbackIndex
from router.index_types import Match
from router.liveness import ApplyOutcome
from router.load import replica_load
from router.policy import ReplicaView, RoutingReason
from router.protocol import ReplicaStats
from router.redis_index import RedisIndex
from router.routing import Router
from tests.router.conftest import FakeClock
from tests.router.helpers import CLEARED, batch, stored

MODEL_ID = "router-model"
CONFIG = RouterConfig(block_size=16)


def view(replica_id: str, **stats) -> ReplicaView:
    """A replica whose stats are its whole load (no tracked requests)."""
    replica_stats = ReplicaStats(**stats)
    return ReplicaView(replica_id, replica_stats, replica_load(replica_stats))


def views(*ids: str, **stats) -> list[ReplicaView]:
    return [view(rid, **stats) for rid in ids]


def prompt(first_token: int, num_tokens: int = 256) -> list[int]:
    return [first_token] + [3] * (num_tokens - 1)


@pytest.fixture
def make_router(make_index):
    """Routers over fresh indexes of the test's backend; their writer threads are closed."""
    routers = []

    def factory(config: RouterConfig = CONFIG, **kwargs) -> Router:
        # Each Redis index gets a fresh namespace, so tests never see each other's replicas.
        routers.append(Router(config, MODEL_ID, index=make_index(), **kwargs))
        return routers[-1]

    yield factory
    for router in routers:
        router.close()


@pytest.mark.parametrize("in_background", [True, False])
def test_sibling_requests_follow_a_speculative_entry_before_any_event(make_router, in_background):
    router = make_router(speculate_in_background=in_background)
    for rid in ("a", "b", "c"):
        router.index.heartbeat(rid, 0)
    shared = prompt(11, 512)
    first = router.route_tokens(shared + [5] * 32, views("a", "b", "c"))
    assert first.reason == "cold"
    router.flush()
    # The sibling shares 32 blocks; no KV event has arrived yet.
    second = router.route_tokens(shared + [9] * 32, views("a", "b", "c"))
    assert (second.replica_id, second.reason, second.matched_blocks) == (
        first.replica_id,
        "prefix",
        32,
    )


def test_baselines_record_no_speculative_entries(make_router):
    router = make_router(RouterConfig(policy="round_robin"))
    router.index.heartbeat("a", 0)
    router.route_tokens(prompt(12), views("a"))
    router.flush()
    assert router.index.match(router.hash_prompt(prompt(12))) == {}


def test_dead_replica_stops_attracting_its_prefix_at_once(make_router, clock):
    router = make_router()
    blocks = router.hash_prompt(prompt(13))
    router.index.heartbeat("a", 0)
    router.index.heartbeat("b", 0)
    router.index.apply(batch("a", 0, stored(blocks)))
    assert router.route(blocks, 256, views("a", "b")).replica_id == "a"
    # The decision's speculative write lands (a round trip; until then the router's own
    # record of it counts, whatever the index knows): the index alone answers from here.
    router.flush()
    clock.advance(CONFIG.heartbeat_timeout_s - 1.0)
    router.index.heartbeat("b", 0)
    clock.advance(1.5)  # "a" is past its deadline; Serve still lists it
    decision = router.route(blocks, 256, views("a", "b"))
    assert decision.matched_blocks == 0 and decision.reason in (
        RoutingReason.COLD,
        RoutingReason.SHORTEST_QUEUE,
        RoutingReason.LOAD_BOUND,
    )


def test_restarted_replica_entries_are_dropped(make_router):
    router = make_router()
    blocks = router.hash_prompt(prompt(14))
    router.index.heartbeat("a", 0)
    router.index.apply(batch("a", 0, stored(blocks)))
    assert router.route(blocks, 256, views("a", "b")).reason == "prefix"
    router.flush()  # its speculative write landed before the restart
    router.index.heartbeat("a", 1)  # new engine, empty cache
    decision = router.route(blocks, 256, views("a", "b"))
    assert decision.matched_blocks == 0


def test_metrics_count_decisions_matched_ratio_and_lookups(make_router):
    router = make_router()
    blocks = router.hash_prompt(prompt(15))  # 16 blocks
    router.index.heartbeat("a", 0)
    router.index.apply(batch("a", 0, stored(blocks[:8])))
    router.route(blocks, 256, views("a", "b", num_waiting=0))
    snapshot = router.metrics.snapshot()
    assert snapshot["decisions"] == [{"policy": "prefix", "reason": "prefix", "count": 1}]
    assert snapshot["matched_block_ratio"] == pytest.approx(0.5)
    assert snapshot["lookup_latency_ms"]["count"] == 1
    assert snapshot["num_fallback_decisions"] == 0


@pytest.mark.redis
def test_redis_down_routes_by_load_logs_once_and_recovers(redis_server, caplog):
    wall, monotonic = FakeClock(), FakeClock()
    redis_index = RedisIndex(redis_server.url, "outage-model", socket_timeout_s=0.2, clock=wall)
    index = FallbackIndex(redis_index, retry_interval_s=1.0, clock=monotonic)
    router = Router(CONFIG, MODEL_ID, index=index, speculate_in_background=False)
    blocks = router.hash_prompt(prompt(16))
    candidates = views("a", "b")
    for rid in ("a", "b"):
        router.index.heartbeat(rid, 0)
    router.index.apply(batch("a", 0, stored(blocks)))
    assert router.route(blocks, 256, candidates).reason == "prefix"

    redis_server.stop()
    caplog.set_level(logging.WARNING, logger="router.index")
    loaded_a = [view("a", num_waiting=5), view("b")]
    decisions = [router.route(blocks, 256, loaded_a) for _ in range(5)]
    assert all(d.reason == "fallback" and d.matched_blocks == 0 for d in decisions)
    assert all(d.replica_id == "b" for d in decisions)  # load alone decides
    assert router.index.apply(batch("a", 1, stored(blocks[:1]))) == ApplyOutcome.IGNORED
    assert router.metrics.snapshot()["num_fallback_decisions"] == 5
    down_logs = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(down_logs) == 1

    redis_server.start()  # empty: everything it knew is gone
    monotonic.advance(1.1)
    # Routed by the index again (nothing known: "cold", or "shortest_queue" once the load bound
    # has steered away from "b", which took the 5 fallback decisions, leaving "a" alone).
    assert router.route(blocks, 256, candidates).reason in (
        RoutingReason.COLD,
        RoutingReason.SHORTEST_QUEUE,
        RoutingReason.LOAD_BOUND,
    )
    # Replicas heartbeat again; "a"'s next batch reveals the gap and it re-announces.
    for rid in ("a", "b"):
        assert router.index.heartbeat(rid, 0)
    assert router.index.apply(batch("a", 2, stored(blocks[:1]))) == ApplyOutcome.STALE
    reannounce = batch("a", 3, CLEARED, stored(blocks))
    assert router.index.apply(reannounce) == ApplyOutcome.APPLIED
    decision = router.route(blocks, 256, candidates)
    assert (decision.replica_id, decision.reason) == ("a", "prefix")
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    redis_index.close()


def test_router_builds_its_index_from_the_config():
    router = Router(RouterConfig(), MODEL_ID)
    assert isinstance(router.index.inner, EmbeddedIndex)
    assert router.policy.name == "prefix"


def test_a_closed_router_still_records_speculative_entries(make_router):
    router = make_router()
    router.index.heartbeat("a", 0)
    router.close()
    decision = router.route_tokens(prompt(17), views("a"))
    assert router.index.match(router.hash_prompt(prompt(17))) == {"a": Match(16, 0)}
    assert decision.reason == RoutingReason.SHORTEST_QUEUE  # one candidate, nothing cached


@pytest.mark.redis
def test_a_failing_speculative_write_is_logged_and_flush_returns(redis_url, caplog):
    # A bucket narrower than half the TTL makes every speculative write a ValueError.
    index = RedisIndex(redis_url, "bad-bucket-model", speculative_bucket_s=1.0)
    router = Router(RouterConfig(speculative_ttl_s=5.0), MODEL_ID, index=index)
    index.heartbeat("a", 0)
    caplog.set_level(logging.ERROR, logger="router.routing")
    router.route_tokens(prompt(18), views("a"))
    router.flush()
    router.route_tokens(prompt(19), views("a"))
    router.flush()  # returns: the writer thread survived the first failure
    assert len([r for r in caplog.records if "speculative entry" in r.getMessage()]) == 2
    router.close()
    index.close()


def test_entries_queued_during_a_write_go_together_in_the_next():
    """The writer's batching: while one write is out, later decisions queue, and the next
    write carries them all in one call, in order; each decision is landed once."""
    from router.metrics import RouterMetrics
    from router.routing import _SpeculativeWriter

    release, calls, landed = threading.Event(), [], []

    class SlowIndex:
        def record_speculative_many(self, entries, ttl_s):
            calls.append([replica for replica, _ in entries])
            release.wait(5)

    writer = _SpeculativeWriter(SlowIndex(), 5.0, RouterMetrics(), landed.append)
    writer.submit("a", [1], 0)
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    for seq, replica in enumerate("bcd", start=1):
        writer.submit(replica, [seq], seq)
    writer.submit("e", [], 4)  # an empty entry is landed, not written
    release.set()
    writer.flush()
    writer.close()
    assert calls == [["a"], ["b", "c", "d"]]
    assert landed == [0, 1, 2, 3, 4]


def test_entries_within_the_linger_of_the_first_go_in_one_write(monkeypatch):
    """The writer waits ``SPECULATIVE_LINGER_S`` after an entry before writing it, so
    decisions made meanwhile share its round trip."""
    from router import routing
    from router.metrics import RouterMetrics

    monkeypatch.setattr(routing, "SPECULATIVE_LINGER_S", 0.5)
    calls, landed = [], []

    class Index:
        def record_speculative_many(self, entries, ttl_s):
            calls.append([replica for replica, _ in entries])

    writer = routing._SpeculativeWriter(Index(), 5.0, RouterMetrics(), landed.append)
    writer.submit("a", [1], 0)
    time.sleep(0.1)  # the writer holds "a" by now, and lingers
    writer.submit("b", [2], 1)
    writer.submit("c", [3], 2)
    writer.flush()
    writer.close()
    assert calls == [["a", "b", "c"]]
    assert landed == [0, 1, 2]


class _AwaitableIndex:
    """An ``EmbeddedIndex`` whose lookups are awaited (as the index actor's client's are),
    failing while ``down``; counts the awaited lookups."""

    def __init__(self) -> None:
        self.inner = EmbeddedIndex()
        self.down = False
        self.num_awaited = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def match_async(self, block_hashes):
        from router.index_types import IndexUnavailableError

        self.num_awaited += 1
        if self.down:
            raise IndexUnavailableError("index actor match took over 0.2s")
        return self.inner.match(block_hashes)


def test_an_awaited_lookup_matches_the_blocking_one_and_falls_back_when_down():
    import asyncio

    monotonic = FakeClock()
    store = _AwaitableIndex()
    router = Router(
        CONFIG,
        MODEL_ID,
        index=FallbackIndex(store, retry_interval_s=1.0, clock=monotonic),
        speculate_in_background=False,
    )
    blocks = router.hash_prompt(prompt(16))
    for rid in ("a", "b"):
        router.index.heartbeat(rid, 0)
    router.index.apply(batch("a", 0, stored(blocks)))
    awaited = asyncio.run(router.lookup_async(blocks))
    assert awaited.matches == router.lookup(blocks).matches
    assert awaited.matches["a"].device_blocks == len(blocks)
    assert store.num_awaited == 1
    store.down = True
    assert asyncio.run(router.lookup_async(blocks)).matches is None  # by load: fallback
    assert asyncio.run(router.lookup_async(blocks)).matches is None
    assert store.num_awaited == 2  # down: not asked again before the retry interval
    store.down = False
    monotonic.advance(1.1)
    assert asyncio.run(router.lookup_async(blocks)).matches["a"].device_blocks == len(blocks)
    assert router.metrics.snapshot()["num_index_errors"] == 1


def test_an_index_without_an_awaitable_lookup_is_asked_in_a_worker_thread():
    import asyncio
    import threading

    threads = []

    class Blocking(EmbeddedIndex):
        def match(self, block_hashes):
            threads.append(threading.current_thread())
            return super().match(block_hashes)

    router = Router(CONFIG, MODEL_ID, index=Blocking(), speculate_in_background=False)
    blocks = router.hash_prompt(prompt(16))
    assert asyncio.run(router.lookup_async(blocks)).matches == {}
    assert threads and threads[0] is not threading.main_thread()
