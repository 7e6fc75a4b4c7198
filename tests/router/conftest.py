"""Fixtures of the router tests: a real redis-server on a free loopback port, a fake clock,
and an index factory parametrized over both backends."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import pytest
import redis

from bench.common import free_port
from router.embedded_index import EmbeddedIndex
from router.index_journal import JournaledIndex
from router.redis_index import RedisIndex

REDIS_BINARY = "redis-server"
# redis-server is ready in ~20 ms on an idle machine; CI machines share 2 cores.
REDIS_START_TIMEOUT_S = 10.0


class RedisServer:
    """A throwaway redis-server without persistence; ``stop``/``start`` keep the port."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                REDIS_BINARY,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    if shutil.which(REDIS_BINARY) is None:
        pytest.skip("redis-server binary not found (Debian: apt-get install -y redis-server)")
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    if redis_server.process is None:
        redis_server.start()  # a previous test stopped it on purpose
    return redis_server.url


class FakeClock:
    """Wall time that only moves when a test says so."""

    def __init__(self, now_s: float = 1_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["embedded", "journaled", pytest.param("redis", marks=pytest.mark.redis)])
def make_index(request, clock):
    """Factory of fresh, empty indexes of one backend sharing the test's fake clock."""
    created = []

    def factory(heartbeat_timeout_s: float = 10.0, model_id: str | None = None):
        if request.param == "embedded":
            return EmbeddedIndex(heartbeat_timeout_s=heartbeat_timeout_s, clock=clock)
        if request.param == "journaled":  # what the index actor hosts: the same contract
            return JournaledIndex(heartbeat_timeout_s=heartbeat_timeout_s, clock=clock)
        url = request.getfixturevalue("redis_url")
        # A fresh namespace per index isolates tests without flushing the shared server.
        index = RedisIndex(
            url,
            model_id or f"test-model-{uuid.uuid4().hex[:8]}",
            heartbeat_timeout_s=heartbeat_timeout_s,
            socket_timeout_s=1.0,
            clock=clock,
        )
        created.append(index)
        return index

    factory.backend = request.param
    yield factory
    for index in created:
        index.close()
