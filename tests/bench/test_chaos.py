"""The chaos benchmark's own parts: its load through the load generator's client (against the
streaming OpenAI test double), outcome classification and the slow-Redis proxy."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from bench.chaos.faults import SlowProxy
from bench.chaos.load import Load, Target, run_load, storm
from bench.chaos.report import markdown, summarize
from bench.loadgen.client import RequestOutput
from tests.bench.openai_double import OpenAIDouble

PROMPTS = [[{"role": "user", "content": f"prompt {i}"}] for i in range(3)]


def test_the_load_and_its_storms_go_through_the_shared_client():
    ticks = []

    async def on_time(elapsed_s: float) -> None:
        ticks.append(elapsed_s)

    with OpenAIDouble() as server:
        target = Target(server.base_url, root_pid=0)
        load = Load(concurrency=2, duration_s=1.2, max_tokens=4)
        outs = asyncio.run(run_load(target, PROMPTS, load, on_time))
        dropped = asyncio.run(storm(target, PROMPTS, 3, 50, drop_after_first=True))
        slow = asyncio.run(storm(target, PROMPTS, 2, 3, slow_read_s=0.05))
    assert len(outs) >= 2 and all(o.done and o.success for o in outs)
    assert {o.conversation_id for o in outs} == {0, 1, 2}  # the prompts in turn
    assert all(o.generated_text == "tok0 tok1 tok2 tok3 " for o in outs)
    # The clock hook at the start and every 0.5 s after (a busy host may wake it late: the
    # load runs long enough for a second tick however late, not for a fourth).
    assert 2 <= len(ticks) <= 3 and ticks[0] < 0.1 and ticks[1] - ticks[0] >= 0.5
    assert server.seen[0]["ignore_eos"] and server.seen[0]["temperature"] == 0
    row = summarize("none", outs, {0: "tok0 tok1 tok2 tok3 "}, None, None)
    assert (row.requests, row.lost, row.errored, row.mismatched) == (len(outs), 0, 0, 0)
    assert [(o.generated_text, o.done, o.error) for o in dropped] == [("tok0 ", False, "")] * 3
    assert all(o.done and o.latency_s >= 0.05 * 4 for o in slow)  # 3 texts, usage, [DONE]


def _out(prompt, start_s, latency_s, ttft_s=None, text="", done=False, error=""):
    """A request of the load as the client records it (times since the load began)."""
    out = RequestOutput(prompt, 0, error=error, start_s=start_s, latency_s=latency_s)
    if ttft_s is not None:
        out.ttft_s, out.token_times_s, out.generated_text = ttft_s, [start_s + ttft_s], text
    out.done, out.success = done, done and not error
    return out


def test_outcomes_are_lost_errored_or_mismatched_against_the_fault_free_run():
    outs = [
        _out(0, 1, 1, ttft_s=0.1, text="same", done=True),
        _out(1, 9, 6, ttft_s=0.3, text="expected", done=True),  # in flight at the fault
        _out(1, 11, 4, ttft_s=2.0, text="other", done=True),  # started during the fault
        _out(0, 12, 3.5, ttft_s=3.0, text="sa"),  # cut after some text, no [DONE]: lost
        _out(1, 13, 0.1, error="HTTP 503"),
        _out(0, 40, 1, ttft_s=0.2, text="same", done=True),  # after recovery
    ]
    res = summarize(
        "replica_kill", outs, {0: "same", 1: "expected"}, fault_at_s=10.0, recovered_at_s=35.0
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
