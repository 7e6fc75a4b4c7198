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
  (``kv_cache_usage_perc`` x ``--num-kv-blocks``); must be 0.

Faults: an engine replica SIGKILLed; the embedded index actor SIGKILLed; an ingress replica
SIGKILLed; a client disconnect storm (streams dropped after their first token); slow readers
(streams never drained for a while). With ``--redis`` the index is a redis-server this script
starts, and two more faults run: Redis killed then restarted, and Redis slowed by a TCP proxy
adding latency. Writes ``bench/results/chaos_<date>.{json,md}``.

Failure modes: the server not starting raises (its log is in the temporary folder printed
at the start); a fault
whose process cannot be found is reported as skipped, not as a pass.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
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


@dataclass
class Outcome:
    index: int
    start_s: float
    ttft_s: float | None = None
    text: str = ""
    done: bool = False
    error: str = ""


@dataclass
class FaultResult:
    fault: str
    requests: int = 0
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


async def run_load(
    url: str, workload: list, concurrency: int, duration_s: float, on_time=None
) -> list[Outcome]:
    """Closed loop: ``concurrency`` workers send the workload round-robin for ``duration_s``;
    ``on_time(elapsed_s)`` is awaited between requests by worker 0 (fault injection)."""
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker(wid: int) -> None:
            while time.monotonic() - t0 < duration_s:
                i = next(counter)
                req = workload[i % len(workload)]
                body = {
                    "messages": req.messages,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                out = Outcome(i % len(workload), time.monotonic())
                outcomes.append(out)
                await one_request(client, url, body, out)

        async def clock() -> None:
            while on_time is not None and time.monotonic() - t0 < duration_s:
                await on_time(time.monotonic() - t0)
                await asyncio.sleep(0.5)

        await asyncio.gather(clock(), *(worker(w) for w in range(concurrency)))
    return outcomes


# -- faults -----------------------------------------------------------------------------------
SERVER_PID: int | None = None
"""The ``prefixserve serve`` process: faults only touch its descendants (its own Ray)."""


def processes_titled(title: str) -> list:
    """The Ray worker processes of our server whose title names ``title``."""
    import psutil

    try:
        tree = psutil.Process(SERVER_PID).children(recursive=True)
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


def sigkill_one(title: str) -> int | None:
    procs = processes_titled(title)
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
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


# -- measuring --------------------------------------------------------------------------------
def probe_ok(url: str, model_body: dict) -> bool:
    try:
        reply = httpx.post(f"{url}/v1/chat/completions", json=model_body, timeout=30)
        return reply.status_code == 200
    except httpx.HTTPError:
        return False


def kv_in_use_blocks(url: str) -> int | None:
    """Blocks held across replicas per ``kv_cache_usage_perc`` (None if not exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    usage = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.endswith("kv_cache_usage_perc")
    ]
    return None if not usage else sum(round(u * NUM_KV_BLOCKS) for u in usage)


def wait_idle_blocks(url: str) -> int | None:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    held = kv_in_use_blocks(url)
    while held and time.monotonic() < deadline:
        time.sleep(1.0)
        held = kv_in_use_blocks(url)
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
        if o.ttft_s is None or fault_at_s is None:
            continue
        started = o.start_s - t0
        if fault_at_s <= started < fault_at_s + DURING_WINDOW_S:
            during.append(o.ttft_s)
        elif recovered_at_s is not None and started >= recovered_at_s:
            after.append(o.ttft_s)
    res.ttft_p99_during_s, res.ttft_p99_after_s = p99(during), p99(after)
    return res


# -- one run ----------------------------------------------------------------------------------
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
        default="replica_kill,index_kill,ingress_kill,disconnect_storm,slow_readers",
        help="comma-separated; with --redis also redis_restart,redis_slow",
    )
    parser.add_argument(
        "--redis", action="store_true", help="use a redis-server index (adds two faults)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from bench.serve.workload import load_workload

    workload = load_workload(16)
    date = datetime.date.today().isoformat()
    out_base = args.out or RESULTS / f"chaos_{date}"
    workdir = Path(tempfile.mkdtemp(prefix="prefixserve-chaos-"))
    print(f"server log and Redis files in {workdir}", file=sys.stderr, flush=True)
    faults = [f for f in args.faults.split(",") if f]
    known = {"replica_kill", "index_kill", "ingress_kill", "disconnect_storm", "slow_readers"}
    unknown = set(faults) - known - ({"redis_restart", "redis_slow"} if args.redis else set())
    if unknown:
        parser.error(
            f"unknown faults (or Redis faults without --redis): {', '.join(sorted(unknown))}"
        )
    redis_proc = proxy = None
    serve_args = []
    if args.redis:
        redis_port = free_port()
        redis_proc = start_redis(redis_port, workdir)
        proxy = SlowProxy(redis_port, REDIS_SLOW_DELAY_S)
        serve_args = ["--redis-url", f"redis://127.0.0.1:{proxy.port}/0"]
        faults += [f for f in ("redis_restart", "redis_slow") if f not in faults]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv_serve = [
        sys.executable,
        "-m",
        "cluster.cli",
        "serve",
        "--num-replicas",
        "2",
        "--num-threads",
        "1",
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        "--port",
        str(port),
        *serve_args,
    ]
    server = Server("prefixserve", argv_serve, workdir / "server.log", env=server_env(1))
    global SERVER_PID
    SERVER_PID = server.proc.pid
    results: list[FaultResult] = []
    probe = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 2}
    try:
        server.wait_ready(f"{url}/v1/models", timeout_s=600, ready=lambda: probe_ok(url, probe))
        print("fault-free run ...", file=sys.stderr, flush=True)
        base = asyncio.run(run_load(url, workload, args.concurrency, args.duration_s))
        baseline = {o.index: o.text for o in base if o.done and not o.error}
        results.append(
            summarize("none", base, baseline, None, None, base[0].start_s if base else 0)
        )
        results[-1].leaked_blocks = wait_idle_blocks(url)
        redis = {"proc": redis_proc}
        for fault in faults:
            print(f"fault {fault} ...", file=sys.stderr, flush=True)
            results.append(
                run_fault(fault, url, workload, args, baseline, probe, redis, proxy, workdir)
            )
        redis_proc = redis["proc"]
    finally:
        server.stop()
        if redis_proc is not None:
            redis_proc.kill()
    header = {
        "benchmark": "chaos",
        "date": date,
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "git_commit": git_commit(),
        "command": "python -m bench.chaos " + " ".join(argv or sys.argv[1:]),
        "load": f"{args.concurrency} closed-loop streams, {args.duration_s:.0f} s per fault, "
        f"{MAX_TOKENS} greedy tokens, 2 engine x 1 thread, 2 ingress replicas",
        "loadavg_start": os.getloadavg(),
    }
    rows = [asdict(r) for r in results]
    Path(f"{out_base}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    Path(f"{out_base}.md").write_text(markdown(header, rows))
    print(markdown(header, rows))
    return 0


def run_fault(
    fault: str,
    url: str,
    workload: list,
    args,
    baseline: dict,
    probe: dict,
    redis: dict,
    proxy: SlowProxy | None,
    workdir: Path,
) -> FaultResult:
    """One load with ``fault`` injected a third of the way in; ``redis["proc"]`` is the
    redis-server process (replaced when the fault restarts it)."""
    fault_at = args.duration_s / 3
    state: dict = {"fault_at_s": None, "recovered_at_s": None, "note": ""}
    titles = {
        "replica_kill": "EngineReplica",
        "index_kill": "IndexActor",
        "ingress_kill": "Ingress",
    }
    extra_tasks: list = []

    async def inject(elapsed_s: float) -> None:
        if state["fault_at_s"] is not None or elapsed_s < fault_at:
            return
        state["fault_at_s"] = elapsed_s
        state["t0_mono"] = time.monotonic() - elapsed_s
        if fault in titles:
            count = len(processes_titled(titles[fault]))
            pid = sigkill_one(titles[fault])
            state["note"] = (
                f"SIGKILL pid {pid} of {count} {titles[fault]}" if pid else "skipped: not found"
            )
            state["wait_title"] = (titles[fault], count)
        elif fault == "disconnect_storm":
            extra_tasks.append(
                asyncio.ensure_future(storm(url, workload, 32, drop_after_first=True))
            )
            state["note"] = "32 streams dropped after their first token"
        elif fault == "slow_readers":
            extra_tasks.append(asyncio.ensure_future(storm(url, workload, 8, slow_read_s=2.0)))
            state["note"] = "8 streams read one line per 2 s until the load ends"
        elif fault == "redis_restart":
            redis["proc"].kill()
            redis["proc"].wait()
            await asyncio.sleep(5.0)
            redis["proc"] = start_redis(proxy.target_port, workdir)
            state["note"] = "restarted: killed, 5 s down, restarted empty"
        elif fault == "redis_slow":
            proxy.slow(True)
            state["note"] = (
                f"+{REDIS_SLOW_DELAY_S * 1000:.0f} ms per chunk each way "
                f"for {DURING_WINDOW_S:.0f} s"
            )
            asyncio.get_running_loop().call_later(DURING_WINDOW_S, proxy.slow, False)
        asyncio.get_running_loop().run_in_executor(None, wait_recovery, url, probe, state)

    async def load() -> list[Outcome]:
        outcomes = await run_load(url, workload, args.concurrency, args.duration_s, on_time=inject)
        for task in extra_tasks:
            task.cancel()
        if proxy is not None:
            proxy.slow(False)
        return outcomes

    t0 = time.monotonic()
    outcomes = asyncio.run(load())
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
    res.leaked_blocks = wait_idle_blocks(url)
    return res


def wait_recovery(url: str, probe: dict, state: dict) -> None:
    """Sets ``recovered_at_s`` (seconds since the load began, like ``fault_at_s``) once a
    probe succeeds and the killed kind of process is back to its count."""
    start = state["t0_mono"]
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    title = state.get("wait_title")
    while time.monotonic() < deadline:
        back = title is None or len(processes_titled(title[0])) >= title[1]
        if back and probe_ok(url, probe):
            state["recovered_at_s"] = time.monotonic() - start
            return
        time.sleep(0.5)


async def storm(
    url: str, workload: list, n: int, *, drop_after_first: bool = False, slow_read_s: float = 0.0
) -> None:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        outs = [Outcome(i, time.monotonic()) for i in range(n)]
        bodies = [
            {
                "messages": workload[i % len(workload)].messages,
                "max_tokens": 256,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            for i in range(n)
        ]
        await asyncio.gather(
            *(
                one_request(
                    client, url, b, o, slow_read_s=slow_read_s, drop_after_first=drop_after_first
                )
                for b, o in zip(bodies, outs, strict=True)
            )
        )


def markdown(header: dict, rows: list[dict]) -> str:
    cols = [
        "fault",
        "requests",
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
