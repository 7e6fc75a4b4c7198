"""How long a short CPU burst takes in wall time on a busy host: the scheduling floor that
every timed section of a benchmark shares. A routing decision that needs 1 ms of CPU takes
at least what a 1 ms burst takes here when it has to wait for a core.

``HostProbe`` starts a child process (default priority, like the servers' processes) that,
every ``period_ms``, spins for ``burst_ms`` of its own CPU time and records the wall time the
burst took; ``stop()`` ends it and returns the summary (``summarize``). Run alone,
``python -m bench.host_probe --seconds 10`` prints the summary for this host as it is now.

How it fails: a child that does not answer within ``STOP_TIMEOUT_S`` of ``stop()`` is killed
and the summary says ``error``; the benchmark's other figures stand.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

from bench.common import percentile
from bench.scale_report import SHARE_ABOVE_MS, SHARE_KEY

STOP_TIMEOUT_S = 10.0


def burst_wall_ms(burst_ms: float) -> float:
    """Spins until this thread has used ``burst_ms`` of CPU; the wall time it took (ms)."""
    start_wall_s, start_cpu_s = time.perf_counter(), time.thread_time()
    while time.thread_time() - start_cpu_s < burst_ms / 1000.0:
        pass
    return 1000.0 * (time.perf_counter() - start_wall_s)


def summarize(walls_ms: list[float], burst_ms: float) -> dict:
    """p50, p99 and max of the bursts' wall times, and the share above ``SHARE_ABOVE_MS``."""
    if not walls_ms:
        return {"burst_ms": burst_ms, "count": 0}
    walls = sorted(walls_ms)
    return {
        "burst_ms": burst_ms,
        "count": len(walls),
        "p50_ms": round(percentile(walls, 50), 3),
        "p99_ms": round(percentile(walls, 99), 3),
        "max_ms": round(walls[-1], 3),
        SHARE_KEY: round(sum(w > SHARE_ABOVE_MS for w in walls) / len(walls), 4),
    }


def probe(burst_ms: float, period_ms: float, seconds: float | None) -> dict:
    """Bursts every ``period_ms`` until ``seconds`` pass or SIGTERM arrives."""
    stop = False

    def on_term(signum, frame) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    walls: list[float] = []
    end_s = None if seconds is None else time.monotonic() + seconds
    while not stop and (end_s is None or time.monotonic() < end_s):
        walls.append(burst_wall_ms(burst_ms))
        time.sleep(period_ms / 1000.0)
    return summarize(walls, burst_ms)


class HostProbe:
    """The probe in a child process, from ``start()`` until ``stop()``."""

    def __init__(self, burst_ms: float = 1.0, period_ms: float = 20.0) -> None:
        self.burst_ms = burst_ms
        self.period_ms = period_ms
        self._proc: subprocess.Popen | None = None

    def start(self) -> HostProbe:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.host_probe",
                "--burst-ms",
                str(self.burst_ms),
                "--period-ms",
                str(self.period_ms),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        return self

    def stop(self) -> dict:
        proc = self._proc
        if proc is None:
            return {"burst_ms": self.burst_ms, "error": "not started"}
        self._proc = None
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=STOP_TIMEOUT_S)
            return json.loads(out)
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            proc.kill()
            proc.wait()
            return {"burst_ms": self.burst_ms, "error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burst-ms", type=float, default=1.0, help="CPU time per burst (ms)")
    p.add_argument("--period-ms", type=float, default=20.0, help="sleep between bursts (ms)")
    p.add_argument(
        "--seconds", type=float, default=None, help="run this long (default: until SIGTERM)"
    )
    args = p.parse_args(argv)
    print(json.dumps(probe(args.burst_ms, args.period_ms, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
