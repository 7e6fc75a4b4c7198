"""One chaos load: fault-free (``run_baseline``) or with one fault injected (``run_fault``),
then the wait for recovery and for the replicas' KV blocks to come back.

``run_fault`` injects the fault a third of the way into the load (from the load's clock hook),
starts ``wait_recovery`` in a thread (a probe request succeeds and the killed kind of process
is back to its count), and once the load is over reads ``kv_cache_usage_perc`` from
``/metrics`` until the held blocks reach 0 or ``IDLE_TIMEOUT_S`` passes.

How it fails: an unknown fault raises ``ValueError``; a cluster that does not recover within
``RECOVERY_TIMEOUT_S`` leaves ``recovery_s`` None; a server without the KV metric leaves
``leaked_blocks`` None. Neither raises: the row says what was not measured.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx

from bench.chaos.faults import (
    KILL_TITLES,
    REDIS_SLOW_DELAY_S,
    RedisSide,
    processes_titled,
    sigkill_one,
    start_redis,
)
from bench.chaos.load import Load, Target, run_load, storm
from bench.chaos.report import DURING_WINDOW_S, FaultResult, summarize
from bench.loadgen.client import RequestOutput

RECOVERY_TIMEOUT_S = 180.0
IDLE_TIMEOUT_S = 60.0


def probe_ok(target: Target, body: dict) -> bool:
    try:
        reply = httpx.post(
            f"{target.url}/v1/chat/completions", json=body, headers=target.headers, timeout=30
        )
        return reply.status_code == 200
    except httpx.HTTPError:
        return False


def kv_in_use_blocks(target: Target) -> int | None:
    """Blocks held across replicas per ``kv_cache_usage_perc`` (None if not exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{target.url}/metrics", headers=target.headers, timeout=10).text
    except httpx.HTTPError:
        return None
    usage = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.endswith("kv_cache_usage_perc")
    ]
    # Rounded up: one held block counts even if num_kv_blocks overstates the replicas' pool.
    return None if not usage else sum(math.ceil(u * target.num_kv_blocks - 1e-6) for u in usage)


def wait_idle_blocks(target: Target, timeout_s: float = IDLE_TIMEOUT_S) -> int | None:
    """Blocks still held once they stop going down to 0 within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    held = kv_in_use_blocks(target)
    while held and time.monotonic() < deadline:
        time.sleep(1.0)
        held = kv_in_use_blocks(target)
    return held


def run_baseline(
    target: Target, prompts: list[list[dict]], load: Load, name: str = "none"
) -> tuple[FaultResult, dict[int, str]]:
    """The fault-free load: its row and each prompt's text (the reference for the faults)."""
    outcomes = asyncio.run(run_load(target, prompts, load))
    baseline = {o.conversation_id: o.generated_text for o in outcomes if o.done and not o.error}
    res = summarize(name, outcomes, baseline, None, None)
    res.leaked_blocks = wait_idle_blocks(target)
    return res, baseline


def run_fault(
    fault: str,
    target: Target,
    prompts: list[list[dict]],
    load: Load,
    baseline: dict[int, str],
    probe: dict,
    redis: RedisSide | None = None,
    fault_at_s: float | None = None,
) -> FaultResult:
    """One load with ``fault`` injected at ``fault_at_s`` (default a third of the way in),
    then the wait for recovery and for the replicas to idle."""
    fault_at = load.duration_s / 3 if fault_at_s is None else fault_at_s
    state: dict = {"fault_at_s": None, "recovered_at_s": None, "note": ""}
    extra_tasks: list = []

    async def inject(elapsed_s: float) -> None:
        if state["fault_at_s"] is not None or elapsed_s < fault_at:
            return
        state["fault_at_s"] = elapsed_s
        state["t0_mono"] = time.monotonic() - elapsed_s
        if fault in KILL_TITLES:
            title = KILL_TITLES[fault]
            count = len(processes_titled(target.root_pid, title))
            pid = sigkill_one(target.root_pid, title)
            state["note"] = f"SIGKILL pid {pid} of {count} {title}" if pid else "skipped: not found"
            state["wait_title"] = (title, count)
        elif fault == "disconnect_storm":
            n = load.storm_streams
            extra_tasks.append(
                asyncio.ensure_future(
                    storm(target, prompts, n, load.storm_max_tokens, drop_after_first=True)
                )
            )
            state["note"] = f"{n} streams dropped after their first token"
        elif fault == "slow_readers":
            n, slow_s = load.slow_streams, load.slow_read_s
            extra_tasks.append(
                asyncio.ensure_future(
                    storm(target, prompts, n, load.storm_max_tokens, slow_read_s=slow_s)
                )
            )
            state["note"] = f"{n} streams read one line per {slow_s:g} s until the load ends"
        elif fault == "redis_restart":
            redis.proc.kill()
            redis.proc.wait()
            await asyncio.sleep(5.0)
            redis.proc = start_redis(redis.proxy.target_port, redis.workdir)
            state["note"] = "restarted: killed, 5 s down, restarted empty"
        elif fault == "redis_slow":
            redis.proxy.slow(True)
            state["note"] = (
                f"+{REDIS_SLOW_DELAY_S * 1000:.0f} ms per chunk each way "
                f"for {DURING_WINDOW_S:.0f} s"
            )
            asyncio.get_running_loop().call_later(DURING_WINDOW_S, redis.proxy.slow, False)
        else:
            raise ValueError(f"unknown fault {fault!r}")
        asyncio.get_running_loop().run_in_executor(None, wait_recovery, target, probe, state)

    async def loaded() -> list[RequestOutput]:
        outcomes = await run_load(target, prompts, load, on_time=inject)
        for task in extra_tasks:
            task.cancel()
        if redis is not None:
            redis.proxy.slow(False)
        return outcomes

    outcomes = asyncio.run(loaded())
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while state["recovered_at_s"] is None and time.monotonic() < deadline:
        time.sleep(0.5)
    res = summarize(fault, outcomes, baseline, state["fault_at_s"], state["recovered_at_s"])
    if state["recovered_at_s"] is not None and state["fault_at_s"] is not None:
        res.recovery_s = round(state["recovered_at_s"] - state["fault_at_s"], 2)
    res.note = state["note"]
    res.leaked_blocks = wait_idle_blocks(target)
    return res


def wait_recovery(target: Target, probe: dict, state: dict) -> None:
    """Sets ``recovered_at_s`` (seconds since the load began, like ``fault_at_s``) once a
    probe succeeds and the killed kind of process is back to its count."""
    start = state["t0_mono"]
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    title = state.get("wait_title")
    while time.monotonic() < deadline:
        back = title is None or len(processes_titled(target.root_pid, title[0])) >= title[1]
        if back and probe_ok(target, probe):
            state["recovered_at_s"] = time.monotonic() - start
            return
        time.sleep(0.5)
