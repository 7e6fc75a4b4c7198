"""The chaos benchmark's own parts: outcome classification and the slow-Redis proxy."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from bench.chaos.faults import SlowProxy
from bench.chaos.load import Outcome
from bench.chaos.report import markdown, summarize


def test_outcomes_are_lost_errored_or_mismatched_against_the_fault_free_run():
    t0 = 100.0
    outs = [
        Outcome(0, t0 + 1, ttft_s=0.1, text="same", done=True, end_s=t0 + 2),
        Outcome(1, t0 + 9, ttft_s=0.3, text="expected", done=True, end_s=t0 + 15),  # cut
        Outcome(1, t0 + 11, ttft_s=2.0, text="other", done=True),  # started during the fault
        Outcome(0, t0 + 12, ttft_s=3.0, text="sa", done=False),  # cut without a word: lost
        Outcome(1, t0 + 13, error="HTTP 503"),
        Outcome(0, t0 + 40, ttft_s=0.2, text="same", done=True),  # after recovery
    ]
    res = summarize(
        "replica_kill",
        outs,
        {0: "same", 1: "expected"},
        fault_at_s=10.0,
        recovered_at_s=35.0,
        t0=t0,
    )
    assert (res.requests, res.lost, res.errored, res.mismatched) == (6, 1, 1, 1)
    assert res.in_flight_at_fault == 1  # started before the fault, ended after it
    assert res.ttft_p99_during_s == 2.99  # bench.common.percentile: 2.0 + 0.99 x (3.0 - 2.0)
    assert res.ttft_p99_after_s == 0.2
    assert res.errors == ["HTTP 503"]
    table = markdown(
        {"date": "d", "cpu": "c", "cpus": 2, "load": "l", "command": "x"}, [res.__dict__]
    )
    assert "| replica_kill | 6 | 1 | 1 | 1 | 1 |" in table


def test_slow_proxy_forwards_and_adds_latency_only_when_slow():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def echo() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(1024):
                    conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    proxy = SlowProxy(server.getsockname()[1], delay_s=0.2)

    def round_trip_s() -> float:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
            start = time.monotonic()
            c.sendall(b"ping")
            assert c.recv(16) == b"ping"
            return time.monotonic() - start

    fast = round_trip_s()
    proxy.slow(True)
    slow = round_trip_s()
    assert slow >= 0.4 > fast or slow - fast >= 0.35, (fast, slow)


def test_unknown_faults_and_redis_faults_without_redis_are_refused(capsys):
    from bench.chaos.cli import main
    from bench.chaos.faults import FAULTS

    assert "tp_worker_kill" in FAULTS
    for faults in ("bogus", "redis_slow"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--faults", faults])
        assert exit_info.value.code == 2
        assert faults in capsys.readouterr().err
