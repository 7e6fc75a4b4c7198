"""router.index.FallbackIndex: when a store counts as down, and what a slow answer costs."""

from __future__ import annotations

import socket
import time

import pytest

from bench.common import free_port
from router.embedded_index import EmbeddedIndex
from router.index import SLOW_ANSWERS_BEFORE_DOWN, FallbackIndex
from router.index_types import IndexUnavailableError
from router.redis_index import RedisIndex


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class FlakyStore:
    """An embedded index whose ``match`` fails as told: ``"slow"`` (a timeout), ``"gone"``
    (refused), or answers (None); counts the calls that reached it."""

    def __init__(self) -> None:
        self.inner = EmbeddedIndex()
        self.failure: str | None = None
        self.num_calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def match(self, block_hashes):
        self.num_calls += 1
        if self.failure == "slow":
            raise IndexUnavailableError("took over 0.05 s", timed_out=True)
        if self.failure == "gone":
            raise IndexUnavailableError("connection refused")
        return self.inner.match(block_hashes)


def fallback(store: FlakyStore, clock: FakeClock) -> FallbackIndex:
    return FallbackIndex(store, retry_interval_s=1.0, clock=clock)


def test_a_slow_answer_costs_its_own_call_not_the_retry_interval():
    store, clock = FlakyStore(), FakeClock()
    index = fallback(store, clock)
    for _ in range(SLOW_ANSWERS_BEFORE_DOWN - 1):
        store.failure = "slow"
        assert index.match_or_none([b"x" * 16]) is None  # this call routes by load
        assert index.available
        store.failure = None
        assert index.match_or_none([b"x" * 16]) == {}  # the next one asks again
    assert store.num_calls == 2 * (SLOW_ANSWERS_BEFORE_DOWN - 1)
    assert index.metrics.snapshot()["num_index_errors"] == SLOW_ANSWERS_BEFORE_DOWN - 1


def test_timeouts_in_a_row_count_the_store_down_until_a_probe_answers():
    store, clock = FlakyStore(), FakeClock()
    index = fallback(store, clock)
    store.failure = "slow"
    for _ in range(SLOW_ANSWERS_BEFORE_DOWN):
        assert index.match_or_none([b"x" * 16]) is None
    assert not index.available
    assert index.match_or_none([b"x" * 16]) is None
    assert store.num_calls == SLOW_ANSWERS_BEFORE_DOWN  # down: not asked again
    clock.now_s += 1.1
    store.failure = None
    assert index.match_or_none([b"x" * 16]) == {}  # the probe answers
    assert index.available


def test_a_store_that_refuses_is_down_at_once():
    store, clock = FlakyStore(), FakeClock()
    index = fallback(store, clock)
    store.failure = "slow"
    index.match_or_none([b"x" * 16])
    store.failure = "gone"
    index.match_or_none([b"x" * 16])
    assert not index.available


def test_redis_says_which_failures_are_timeouts():
    refused = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", "m", socket_timeout_s=0.05)
    with pytest.raises(IndexUnavailableError) as caught:
        refused.match([b"x" * 16])
    assert not caught.value.timed_out
    silent = socket.socket()  # accepts connections (its backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        port = silent.getsockname()[1]
        stalled = RedisIndex(f"redis://127.0.0.1:{port}/0", "m", socket_timeout_s=0.05)
        start_s = time.monotonic()
        with pytest.raises(IndexUnavailableError) as caught:
            stalled.match([b"x" * 16])
        assert caught.value.timed_out
        assert time.monotonic() - start_s < 2.0
    finally:
        silent.close()
