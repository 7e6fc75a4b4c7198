"""The prefix index over an authenticated, TLS-encrypted Redis (``rediss://``), as a managed
Redis (ElastiCache, Memorystore, Azure Cache) is reached: a real redis-server with a TLS port
and ``requirepass``, a certificate authority and server certificate made by ``openssl``."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

from bench.common import free_port
from router.index_types import IndexUnavailableError, Match
from router.redis_index import REDIS_PASSWORD_ENV, RedisIndex
from tests.router.conftest import REDIS_BINARY
from tests.router.helpers import batch, chain, stored

PASSWORD = "tenant-secret"
# A TLS handshake on a loaded 2-core machine: far slower than the index's 50 ms default.
SOCKET_TIMEOUT_S = 5.0


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    if shutil.which(REDIS_BINARY) is None or shutil.which("openssl") is None:
        pytest.skip("needs Debian's redis-server and openssl")
    d = tmp_path_factory.mktemp("redis-tls")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
        cwd=d,
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            REDIS_BINARY,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(d / "server.pem"),
            "--tls-key-file",
            str(d / "server.key"),
            "--tls-ca-cert-file",
            str(d / "ca.pem"),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            PASSWORD,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={d / 'ca.pem'}"
    client = redis.Redis.from_url(url, password=PASSWORD, socket_timeout=SOCKET_TIMEOUT_S)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None:
                pytest.fail(f"redis-server with TLS did not start: {proc.stdout.read().decode()}")
            assert time.monotonic() < deadline, "redis-server with TLS did not answer"
            time.sleep(0.05)
    client.close()
    yield url
    proc.kill()
    proc.wait(timeout=10)


def test_index_works_over_tls_with_the_password_in_the_url(tls_redis, clock):
    url = tls_redis.replace("rediss://", f"rediss://:{PASSWORD}@")
    index = RedisIndex(url, "tls-model", socket_timeout_s=SOCKET_TIMEOUT_S, clock=clock)
    blocks = chain(3)
    index.heartbeat("r0", 0)
    index.apply(batch("r0", 0, stored(blocks)))
    assert index.match(blocks) == {"r0": Match(3, 0)}


def test_password_from_the_environment_as_the_chart_passes_it(tls_redis, clock, monkeypatch):
    monkeypatch.setenv(REDIS_PASSWORD_ENV, PASSWORD)
    index = RedisIndex(tls_redis, "tls-model-env", socket_timeout_s=SOCKET_TIMEOUT_S, clock=clock)
    index.heartbeat("r0", 0)
    assert index.match(chain(2)) == {}


def test_wrong_password_or_plaintext_is_an_unavailable_index_not_a_crash(tls_redis, clock):
    wrong = tls_redis.replace("rediss://", "rediss://:not-the-password@")
    with pytest.raises(IndexUnavailableError, match="127.0.0.1") as failure:
        RedisIndex(wrong, "tls-model", socket_timeout_s=SOCKET_TIMEOUT_S, clock=clock).match(
            chain(1)
        )
    assert "not-the-password" not in str(failure.value) and ":***@" in str(failure.value)
    plain = tls_redis.replace("rediss://", f"redis://:{PASSWORD}@").split("?")[0]
    with pytest.raises(IndexUnavailableError):
        RedisIndex(plain, "tls-model", socket_timeout_s=SOCKET_TIMEOUT_S, clock=clock).match(
            chain(1)
        )
