"""Chaos benchmark: faults injected under a steady load of streaming requests, with figures.

``python -m bench.chaos`` starts ``prefixserve serve`` (2 engine replicas, 2 ingress
replicas, the bundled model) once, runs a fault-free load to record every request's greedy
text, then for each fault runs the same load again and injects the fault a third of the way
in. Per fault it reports:

- ``lost``: requests that neither finished nor got an error (hung, or cut without a word);
  must be 0;
- ``errored``: requests that got an HTTP error or an ``error`` event (target 0 for replica
  and index faults: the ingress fails streams over);
- ``mismatched``: finished requests whose text differs from the fault-free run;
- TTFT p99 during the fault (requests started in the ``DURING_WINDOW_S`` after it) and after
  recovery;
- ``recovery_s``: from the fault until a probe request succeeds and the killed kind of
  process is back to its count;
- ``leaked_blocks``: KV blocks still held once the load is over and the replicas idle
  (``kv_cache_usage_perc`` x the replica's KV blocks); must be 0.

Faults: an engine replica SIGKILLed; the embedded index actor SIGKILLed; an ingress replica
SIGKILLed; a client disconnect storm (streams dropped after their first token); slow readers
(streams never drained for a while). With ``--redis`` the index is a redis-server this script
starts, and two more faults run: Redis killed then restarted, and Redis slowed by a TCP proxy
adding latency. ``tp_worker_kill`` SIGKILLs one tensor-parallel worker (rank 1) of an engine
replica: it runs on a second server started with ``--tensor-parallel-size 2`` after the
others, with its own fault-free run (outputs may differ between TP degrees). Writes
``bench/results/chaos_<date>.{json,md}``.

The parts are importable (``Target``, ``Load``, ``run_baseline``, ``run_fault``): the CI-sized
suite in ``tests/chaos/`` runs them against a tiny-model cluster started by pytest, with the
pytest process as the root whose descendants faults may touch.

Failure modes: the server not starting raises (its log is in the temporary folder printed
at the start); a fault whose process cannot be found is reported as skipped, not as a pass.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.serve.processes import REPO, Server, free_port, server_env
from bench.serve.report import cpu_model, git_commit

RESULTS = REPO / "bench" / "results"
MAX_TOKENS = 32
DURING_WINDOW_S = 20.0
RECOVERY_TIMEOUT_S = 180.0
IDLE_TIMEOUT_S = 60.0
NUM_KV_BLOCKS = 1024
REQUEST_TIMEOUT_S = 300.0
REDIS_SLOW_DELAY_S = 0.05
"""Latency the slow-Redis proxy adds to each chunk, each way."""
KILL_TITLES = {
    "replica_kill": "EngineReplica",
    "index_kill": "IndexActor",
    "ingress_kill": "Ingress",
    "tp_worker_kill": "TensorParallelWorker",
}
"""Faults that SIGKILL one Ray worker process, by the title (``ray::...``) it runs under."""
FAULTS = (*KILL_TITLES, "disconnect_storm", "slow_readers")
REDIS_FAULTS = ("redis_restart", "redis_slow")
TP_FAULTS = ("tp_worker_kill",)
"""Faults that need a server whose replicas run tensor-parallel workers."""
TP_SIZE = 2


@dataclass(frozen=True)
class Target:
    """A running cluster: where the load goes and which processes faults may touch."""

    url: str
    root_pid: int
    """Faults SIGKILL only descendants of this process (the server, or the test that started
    Ray), never another cluster on the same machine."""
    headers: dict = field(default_factory=dict)
    num_kv_blocks: int = NUM_KV_BLOCKS
    """KV blocks per engine replica, to turn ``kv_cache_usage_perc`` into blocks."""


@dataclass(frozen=True)
class Load:
    """The steady load and the sizes of the client-side faults."""

    concurrency: int = 8
    duration_s: float = 60.0
    max_tokens: int = MAX_TOKENS
    storm_streams: int = 32
    storm_max_tokens: int = 256
    slow_streams: int = 8
    slow_read_s: float = 2.0


@dataclass
class Outcome:
    index: int
    start_s: float
    ttft_s: float | None = None
    text: str = ""
    done: bool = False
    error: str = ""
    end_s: float | None = None
    """When the stream ended (finished, failed or dropped); None while it runs."""


@dataclass
class FaultResult:
    fault: str
    requests: int = 0
    in_flight_at_fault: int = 0
    """Requests of the load started before the fault and still streaming when it hit."""
    lost: int = 0
    errored: int = 0
    mismatched: int = 0
    ttft_p99_during_s: float | None = None
    ttft_p99_after_s: float | None = None
    recovery_s: float | None = None
    leaked_blocks: int | None = None
    note: str = ""
    errors: list[str] = field(default_factory=list)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(0.99 * len(values)))], 3)


# -- the load ---------------------------------------------------------------------------------
def chat_body(messages: list[dict], max_tokens: int) -> dict:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    out: Outcome,
    slow_read_s: float = 0.0,
    drop_after_first: bool = False,
) -> None:
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                out.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return
            async for line in reply.aiter_lines():
                if slow_read_s:
                    await asyncio.sleep(slow_read_s)
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out.done = True
                    return
                event = json.loads(data)
                if "error" in event:
                    out.error = str(event["error"].get("message", event["error"]))[:200]
                    return
                for choice in event.get("choices", ()):
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text and out.ttft_s is None:
                        out.ttft_s = time.monotonic() - out.start_s
                        if drop_after_first:
                            return
                    out.text += text
    except (httpx.HTTPError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        out.end_s = time.monotonic()


async def run_load(
    target: Target, prompts: list[list[dict]], load: Load, on_time=None
) -> list[Outcome]:
    """Closed loop: ``load.concurrency`` workers send ``prompts`` (chat messages) round-robin
    for ``load.duration_s``; ``on_time(elapsed_s)`` is awaited every 0.5 s (fault injection)."""
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=load.concurrency + 8)
    async with httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT_S, limits=limits, headers=target.headers
    ) as client:

        async def worker() -> None:
            while time.monotonic() - t0 < load.duration_s:
                i = next(counter) % len(prompts)
                out = Outcome(i, time.monotonic())
                outcomes.append(out)
                await one_request(client, target.url, chat_body(prompts[i], load.max_tokens), out)

        async def clock() -> None:
            while on_time is not None and time.monotonic() - t0 < load.duration_s:
                await on_time(time.monotonic() - t0)
                await asyncio.sleep(0.5)

        await asyncio.gather(clock(), *(worker() for _ in range(load.concurrency)))
    return outcomes


async def storm(
    target: Target,
    prompts: list[list[dict]],
    n: int,
    max_tokens: int,
    *,
    drop_after_first: bool = False,
    slow_read_s: float = 0.0,
) -> list[Outcome]:
    """``n`` extra streams at once, dropped after their first token or read slowly."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, headers=target.headers) as client:
        outs = [Outcome(i % len(prompts), time.monotonic()) for i in range(n)]
        await asyncio.gather(
            *(
                one_request(
                    client,
                    target.url,
                    chat_body(prompts[o.index], max_tokens),
                    o,
                    slow_read_s=slow_read_s,
                    drop_after_first=drop_after_first,
                )
                for o in outs
            )
        )
    return outs


# -- faults -----------------------------------------------------------------------------------
def processes_titled(root_pid: int, title: str) -> list:
    """The Ray worker processes under ``root_pid`` whose title (``ray::...``) names ``title``."""
    import psutil

    try:
        tree = psutil.Process(root_pid).children(recursive=True)
    except (psutil.NoSuchProcess, ValueError, TypeError):
        return []
    found = []
    for p in tree:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if cmd.startswith("ray::") and title in cmd:
            found.append(p)
    return found


def sigkill_one(root_pid: int, title: str) -> int | None:
    procs = processes_titled(root_pid, title)
    if not procs:
        return None
    os.kill(procs[0].pid, signal.SIGKILL)
    return procs[0].pid


class SlowProxy:
    """A TCP proxy in a thread that delays every chunk by ``delay_s`` (a slow Redis)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.port, self.target_port, self.delay_s = free_port(), target_port, 0.0
        self._delay_when_slow = delay_s
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)

    def slow(self, on: bool) -> None:
        self.delay_s = self._delay_when_slow if on else 0.0

    async def _serve(self) -> None:
        async def pipe(reader, writer) -> None:
            try:
                while data := await reader.read(65536):
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        async def handle(reader, writer) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        self._server = await asyncio.start_server(handle, "127.0.0.1", self.port)


def start_redis(port: int, workdir: Path) -> subprocess.Popen:
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(workdir)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


@dataclass
class RedisSide:
    """The redis-server behind the index (replaced when a fault restarts it) and its proxy."""

    proc: subprocess.Popen
    proxy: SlowProxy
    workdir: Path


# -- measuring --------------------------------------------------------------------------------
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


def summarize(
    name: str,
    outcomes: list[Outcome],
    baseline: dict[int, str],
    fault_at_s: float | None,
    recovered_at_s: float | None,
    t0: float,
) -> FaultResult:
    res = FaultResult(fault=name, requests=len(outcomes))
    during, after = [], []
    for o in outcomes:
        if o.error:
            res.errored += 1
            if len(res.errors) < 5:
                res.errors.append(o.error)
        elif not o.done:
            res.lost += 1
        elif o.index in baseline and baseline[o.index] != o.text:
            res.mismatched += 1
        if fault_at_s is None:
            continue
        started = o.start_s - t0
        if started < fault_at_s and (o.end_s is None or o.end_s - t0 > fault_at_s):
            res.in_flight_at_fault += 1
        if o.ttft_s is None:
            continue
        if fault_at_s <= started < fault_at_s + DURING_WINDOW_S:
            during.append(o.ttft_s)
        elif recovered_at_s is not None and started >= recovered_at_s:
            after.append(o.ttft_s)
    res.ttft_p99_during_s, res.ttft_p99_after_s = p99(during), p99(after)
    return res


# -- one load: fault-free or with one fault ----------------------------------------------------
def run_baseline(
    target: Target, prompts: list[list[dict]], load: Load, name: str = "none"
) -> tuple[FaultResult, dict[int, str]]:
    """The fault-free load: its row and each prompt's text (the reference for the faults)."""
    outcomes = asyncio.run(run_load(target, prompts, load))
    baseline = {o.index: o.text for o in outcomes if o.done and not o.error}
    res = summarize(name, outcomes, baseline, None, None, 0.0)
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

    async def loaded() -> list[Outcome]:
        outcomes = await run_load(target, prompts, load, on_time=inject)
        for task in extra_tasks:
            task.cancel()
        if redis is not None:
            redis.proxy.slow(False)
        return outcomes

    t0 = time.monotonic()
    outcomes = asyncio.run(loaded())
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while state["recovered_at_s"] is None and time.monotonic() < deadline:
        time.sleep(0.5)
    res = summarize(
        fault,
        outcomes,
        baseline,
        state["fault_at_s"],
        state["recovered_at_s"],
        outcomes[0].start_s if outcomes else t0,
    )
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


# -- the benchmark ----------------------------------------------------------------------------
def run_server(
    faults: list[str],
    args,
    prompts: list[list[dict]],
    workdir: Path,
    *,
    tp: int = 1,
    serve_args: tuple[str, ...] = (),
    redis: RedisSide | None = None,
) -> list[FaultResult]:
    """One ``prefixserve serve`` (``tp`` ranks per replica): a fault-free run, then
    ``faults`` one after another."""
    port = free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--num-replicas", "2"]
    argv += ["--num-threads", "1", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--port", str(port)]
    argv += ["--tensor-parallel-size", str(tp), *serve_args]
    log = workdir / f"server_tp{tp}.log"
    server = Server("prefixserve", argv, log, env=server_env(1))
    target = Target(f"http://127.0.0.1:{port}", server.proc.pid)
    load = Load(concurrency=args.concurrency, duration_s=args.duration_s)
    probe = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 2}
    results: list[FaultResult] = []
    try:
        server.wait_ready(
            f"{target.url}/v1/models", timeout_s=600, ready=lambda: probe_ok(target, probe)
        )
        name = "none" if tp == 1 else f"none (tp {tp})"
        print(f"fault-free run ({name}) ...", file=sys.stderr, flush=True)
        row, baseline = run_baseline(target, prompts, load, name)
        results.append(row)
        for fault in faults:
            print(f"fault {fault} ...", file=sys.stderr, flush=True)
            results.append(run_fault(fault, target, prompts, load, baseline, probe, redis))
    finally:
        server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--duration-s", type=float, default=60.0, help="load per fault (default 60)"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help="comma-separated (tp_worker_kill on a second server with --tensor-parallel-size "
        f"{TP_SIZE}); with --redis also {','.join(REDIS_FAULTS)}",
    )
    parser.add_argument(
        "--redis", action="store_true", help="use a redis-server index (adds two faults)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS) - (set(REDIS_FAULTS) if args.redis else set())
    if unknown:
        parser.error(
            f"unknown faults (or Redis faults without --redis): {', '.join(sorted(unknown))}"
        )
    from bench.serve.workload import load_workload

    prompts = [request.messages for request in load_workload(16)]
    date = datetime.date.today().isoformat()
    out_base = args.out or RESULTS / f"chaos_{date}"
    workdir = Path(tempfile.mkdtemp(prefix="prefixserve-chaos-"))
    print(f"server logs and Redis files in {workdir}", file=sys.stderr, flush=True)
    redis, serve_args = None, ()
    if args.redis:
        redis_port = free_port()
        redis = RedisSide(
            start_redis(redis_port, workdir), SlowProxy(redis_port, REDIS_SLOW_DELAY_S), workdir
        )
        serve_args = ("--redis-url", f"redis://127.0.0.1:{redis.proxy.port}/0")
        faults += [f for f in REDIS_FAULTS if f not in faults]
    tp_faults = [f for f in faults if f in TP_FAULTS]
    results: list[FaultResult] = []
    try:
        plain = [f for f in faults if f not in TP_FAULTS]
        if plain or not tp_faults:
            results += run_server(plain, args, prompts, workdir, serve_args=serve_args, redis=redis)
        if tp_faults:
            results += run_server(
                tp_faults, args, prompts, workdir, tp=TP_SIZE, serve_args=serve_args, redis=redis
            )
    finally:
        if redis is not None:
            redis.proc.kill()
    load = f"{args.concurrency} closed-loop streams, {args.duration_s:.0f} s per fault, "
    load += f"{MAX_TOKENS} greedy tokens, 2 engine x 1 thread, 2 ingress replicas"
    if tp_faults:
        load += f" ({', '.join(tp_faults)}: engines at --tensor-parallel-size {TP_SIZE})"
    header = {
        "benchmark": "chaos",
        "date": date,
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "git_commit": git_commit(),
        "command": "python -m bench.chaos " + " ".join(argv or sys.argv[1:]),
        "load": load,
        "loadavg_start": os.getloadavg(),
    }
    rows = [asdict(r) for r in results]
    Path(f"{out_base}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    Path(f"{out_base}.md").write_text(markdown(header, rows))
    print(markdown(header, rows))
    return 0


def markdown(header: dict, rows: list[dict]) -> str:
    cols = [
        "fault",
        "requests",
        "in_flight_at_fault",
        "lost",
        "errored",
        "mismatched",
        "ttft_p99_during_s",
        "ttft_p99_after_s",
        "recovery_s",
        "leaked_blocks",
        "note",
    ]
    lines = [
        f"Chaos run {header['date']} ({header['cpu']}, {header['cpus']} CPUs): {header['load']}.",
        f"Command: `{header['command']}`",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append(
            "| " + " | ".join("-" if r.get(c) is None else str(r.get(c)) for c in cols) + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
