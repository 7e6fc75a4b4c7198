"""The engine's own host time per decode step, measured with the simulated engine.

    python -m bench.engine_host [--batch 64 256] [--steps 100] [--repeats 5] [--profile gpu]
    python -m bench.engine_host --graph-inputs [CONTEXT ...]   # graph-input writes per step
    python -m bench.engine_host --detokenize TOKENS            # detokenizer cost along an output
    python -m bench.engine_host --one-request REQUESTS         # a lone request, overlapped or not

With ``engine="sim"`` the forward pass is a wait (``worker/sim_runner.py``), so the CPU time a
step takes (``time.process_time``, which a wait does not advance) is the engine's host work
alone: scheduling, input preparation, sampling, stop checks and detokenizing, building the
streamed outputs (``LLMEngine.step_deltas``, what a server steps). Per batch size: ``batch``
requests of 32-token prompts, 128 greedy output tokens with EOS ignored, all admitted and
past their prefill before the measured steps; then ``--steps`` decode steps, each timed on
its own, two ways:

- **device wait slept**: each step sleeps out the profile's forward-pass time, as the
  simulated engine does when it serves. On a VM the sleeping CPU comes back with cold caches
  (and, on a shared host, after other tenants), so this figure is the larger and the noisier;
- **no device wait**: steps back to back (``SimModelRunner.waits_for_device = False``), the
  caches warm, as on a GPU host whose engine thread spins in the device sync.

Each way runs ``--repeats`` times on a fresh engine; a row reports the median of the
repeats' median CPU-ms per step, their range, the p90 and CPU-us per token, beside the
profile's own step time (the device time a GPU would take). A third way, no device wait,
times what the engine process's loop does per step around that (``worker/engine_process.py``):
``EngineLoop.step`` (the step, its stats and metrics) and the ``("step", StepResult)``
message pickled as the engine socket pickles it, each on its own, with the message's bytes. Writes
``bench/results/engine_host_cpu_<UTC date><--tag>.json`` and a ``.png`` of host against
device time per step.

A fourth way, the device wait slept, times the engine loop's wall time per step (the step
and its message pickled) with each step's outputs built and reported before the next step is
launched, and with the next launched first (``EngineConfig.overlap_outputs``): what the
overlap hides of the host's work in the device's time.

A GPU engine whose host time per step exceeds its device time idles the GPU: the ratio in
the table says how far this engine is from keeping the profile's device busy.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from bench.result_files import result_header, result_stem
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.engine_core import EngineLoop
from worker.sampling_params import SamplingParams
from worker.sim_model import load_profile

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 128


def _admit(
    engine: LLMEngine,
    batch: int,
    prompt_tokens: int = PROMPT_TOKENS,
    max_tokens: int = OUTPUT_TOKENS,
) -> None:
    """Adds ``batch`` requests of ``max_tokens`` each and steps them past their prefill (not
    measured)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_computed_tokens < prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step_deltas()


def _sim_engine(
    batch: int, profile: str, model: str, wait: bool, async_scheduling: str = "auto"
) -> LLMEngine:
    """A fresh simulated engine with ``batch`` requests past their prefill."""
    config = EngineConfig(
        model=model,
        engine="sim",
        sim_profile=profile,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * PROMPT_TOKENS),
        device="cpu",
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config)
    engine.runner.waits_for_device = wait
    _admit(engine, batch)
    return engine


def _step_cpu_ms(batch: int, steps: int, profile: str, model: str, wait: bool) -> list[float]:
    """CPU-ms of each of ``steps`` decode steps of a fresh engine running ``batch`` requests."""
    engine = _sim_engine(batch, profile, model, wait)
    cpu_ms = []
    for _ in range(min(steps, OUTPUT_TOKENS - 2)):
        start_s = time.process_time()
        engine.step_deltas()
        cpu_ms.append((time.process_time() - start_s) * 1000)
    assert len(engine.scheduler.running) == batch, "every request decodes in every step"
    return cpu_ms


def _loop_cpu_ms(batch: int, steps: int, profile: str, model: str):
    """(CPU-ms of each ``EngineLoop.step``, CPU-ms of pickling each step's message, the last
    message's bytes) over ``steps`` decode steps, no device wait."""
    engine = _sim_engine(batch, profile, model, wait=False)
    loop = EngineLoop(engine)
    loop_ms, message_ms, size = [], [], 0
    for _ in range(min(steps, OUTPUT_TOKENS - 2)):
        start_s = time.process_time()
        result = loop.step()
        stepped_s = time.process_time()
        size = len(ForkingPickler.dumps(("step", result)))
        loop_ms.append((stepped_s - start_s) * 1000)
        message_ms.append((time.process_time() - stepped_s) * 1000)
    assert len(engine.scheduler.running) == batch, "every request decodes in every step"
    return loop_ms, message_ms, size


def _loop_wall_ms(batch: int, steps: int, profile: str, model: str, overlap: bool) -> list[float]:
    """Wall ms of each of ``steps`` engine-loop steps (``EngineLoop.step`` and its message
    pickled), the device wait slept: with the next step launched before each step's outputs
    are built (``overlap``), or each step reported before the next is scheduled."""
    engine = _sim_engine(batch, profile, model, wait=True)
    loop = EngineLoop(engine)
    loop.overlap = overlap
    walls_ms = []
    for _ in range(min(steps, OUTPUT_TOKENS - 3)):
        start_s = time.perf_counter()
        ForkingPickler.dumps(("step", loop.step()))
        walls_ms.append((time.perf_counter() - start_s) * 1000)
    assert len(engine.scheduler.running) == batch, "every request decodes in every step"
    return walls_ms[1:]  # an overlapped loop's first step only launches


def one_request_ms(
    overlap: bool, requests: int, profile: str, model: str, prompt_tokens: int = 200
) -> tuple[float, float]:
    """(median time to the first token, median time to the last) of ``requests`` requests
    sent one at a time through the simulated engine's loop (``EngineLoop``), the device wait
    slept, with the next step launched before each step's outputs are built (``overlap``) or
    not: what the overlap costs a lone request's first token, and what it saves its whole."""
    from worker.engine_commands import Add

    engine = LLMEngine(
        EngineConfig(
            model=model,
            engine="sim",
            sim_profile=profile,
            device="cpu",
            overlap_outputs="on" if overlap else "off",
        )
    )
    loop = EngineLoop(engine)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    rng = random.Random(0)
    firsts_ms, totals_ms = [], []
    for i in range(requests):
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        start_s, first_s, done = time.perf_counter(), None, False
        loop.handle(Add(f"r{i}", prompt, params))
        while not done:
            result = loop.step()
            for delta in result.outputs if result else []:
                first_s = first_s or time.perf_counter()
                done = done or delta.finished
        totals_ms.append((time.perf_counter() - start_s) * 1000)
        firsts_ms.append((first_s - start_s) * 1000)
        while not loop.idle():
            loop.step()
    return statistics.median(firsts_ms), statistics.median(totals_ms)


def decode_engine(
    model: str,
    batch: int,
    steps: int,
    device: str,
    deterministic: bool = True,
    prompt_tokens: int = PROMPT_TOKENS,
    admit: bool = True,
    async_scheduling: str = "auto",
) -> tuple[LLMEngine, int]:
    """A real engine on ``device`` sized for ``batch`` requests of ``prompt_tokens`` that
    decode for at least ``steps`` steps once admitted, and their ``max_tokens``; with
    ``admit``, the requests added and past their prefill."""
    step_tokens = max(2048, min(batch * prompt_tokens, 8192))
    # The requests admitted first decode while the later ones prefill: each request gets
    # enough tokens to stay running through the admission steps and the measured ones.
    admission_steps = -(-batch * prompt_tokens // step_tokens)
    max_tokens = admission_steps + steps + 2
    config = EngineConfig(
        model=model,
        max_num_seqs=batch,
        max_num_batched_tokens=step_tokens,
        num_kv_blocks=batch * (-(-(prompt_tokens + max_tokens) // 16) + 1) + 64,
        device=device,
        deterministic=deterministic,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config)
    if admit:
        _admit(engine, batch, prompt_tokens, max_tokens)
    return engine, max_tokens


def device_steps(
    model: str,
    batch: int,
    steps: int,
    device: str,
    deterministic: bool = True,
    profile_to: Path | None = None,
    prompt_tokens: int = PROMPT_TOKENS,
    through_loop: bool = False,
    overlap: bool = False,
    async_scheduling: str = "auto",
) -> dict:
    """A real engine's decode steps on ``device``, each split into host time and device wait.

    The engine's runner is wrapped so that after it launches a step's forward pass the wrapper
    waits for the device (``torch.cuda.synchronize``) and times that wait; the sampler's own
    copy of the sampled ids then finds the device idle. A step's wall time minus that wait is
    the host's share: the time the device sits idle, waiting for the engine. On the CPU the
    forward pass runs inside the launch, so the wait is zero and the host share includes it
    (a dry run of the code, not a figure). ``profile_to``: write a cProfile of the measured
    steps there, by own time and by cumulative time. ``prompt_tokens``: each request's prompt
    (the decode steps' context is that plus the tokens decoded so far). ``through_loop``:
    step through the engine process's loop (``EngineLoop.step``: the step, its stats and
    metrics) and pickle each step's message as the engine socket does; the row adds the
    message's own host time and bytes, and its host share is the engine process's.
    ``overlap`` (with ``through_loop``): the loop launches each step before it reports the
    one before (``EngineConfig.overlap_outputs``); the device is then not waited for apart
    from the sampling, so the row has the step's wall time and no split; ``async_scheduling``
    (``EngineConfig``'s, with ``overlap``): whether a step of plain greedy rows lets the next
    one launch before its tokens reach the host."""
    import torch

    engine, max_tokens = decode_engine(
        model, batch, steps, device, deterministic, prompt_tokens, False, async_scheduling
    )
    execute = engine.runner.execute
    waits_s: list[float] = []

    def timed_execute(*args, **kwargs):
        out = execute(*args, **kwargs)
        if device.startswith("cuda"):
            start_s = time.perf_counter()
            torch.cuda.synchronize()
            waits_s.append(time.perf_counter() - start_s)
        else:
            waits_s.append(0.0)
        return out

    if not overlap:
        engine.runner.execute = timed_execute
    _admit(engine, batch, prompt_tokens, max_tokens)
    loop = EngineLoop(engine) if through_loop else None
    if loop is not None:
        loop.overlap = overlap
    walls_ms, waits_ms, messages_ms, message_bytes = [], [], [], 0
    profiler = cProfile.Profile() if profile_to else None
    if profiler:
        profiler.enable()
    for _ in range(steps):
        waits_s.clear()
        start_s = time.perf_counter()
        if loop is None:
            engine.step_deltas()
        else:
            result = loop.step()
            stepped_s = time.perf_counter()
            message_bytes = len(ForkingPickler.dumps(("step", result)))
            messages_ms.append((time.perf_counter() - stepped_s) * 1000)
        walls_ms.append((time.perf_counter() - start_s) * 1000)
        waits_ms.append(sum(waits_s) * 1000)
    if profiler:
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        profile_to.write_text(text.getvalue())
    assert len(engine.scheduler.running) == batch, "every request decodes in every step"
    hosts_ms = [wall - wait for wall, wait in zip(walls_ms, waits_ms, strict=True)]
    wall, host = statistics.median(walls_ms), statistics.median(hosts_ms)
    row = {
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "steps": len(walls_ms),
        "deterministic": deterministic,
        "graphs": engine.runner.step_graphs is not None,
        "through_loop": through_loop,
        "overlap": overlap,
        "scheduled_ahead": overlap and engine.schedules_ahead,
        "step_ms_p50": round(wall, 3),
        "device_wait_ms_p50": round(statistics.median(waits_ms), 3),
        "host_ms_p50": round(host, 3),
        "host_ms_p90": round(statistics.quantiles(hosts_ms, n=10)[-1], 3),
        "host_share_of_step": round(host / wall, 3) if wall else 0.0,
        "tokens_per_s": round(batch / wall * 1000, 1) if wall else 0.0,
    }
    if through_loop:
        row["message_ms_p50"] = round(statistics.median(messages_ms), 3)
        row["message_bytes"] = message_bytes
    if overlap:  # no wait of its own to take out of the wall time
        for key in ("device_wait_ms_p50", "host_ms_p50", "host_ms_p90", "host_share_of_step"):
            row[key] = None
    return row


def graph_inputs_ms(batch: int, context_tokens: int, steps: int = 50) -> float:
    """Host time of writing one decode step's inputs into ``StepGraphs``' static buffers (the
    CPU's eager run of the padded buffers, with a forward pass that does nothing): ``batch``
    sequences at ``context_tokens`` each, their tables growing by a block every 16 steps as
    a decode's do. Median ms per step."""
    import torch

    from worker.cuda_graphs import StepGraphs
    from worker.parallel.step_message import StepInputs

    block_size = 16
    vocab = 8
    graphs = StepGraphs(
        lambda ids, positions, meta, rows: torch.zeros(len(rows), vocab),
        max_num_seqs=batch,
        max_num_batched_tokens=2048,
        max_blocks_per_seq=-(-(context_tokens + steps) // block_size) + 1,
        block_size=block_size,
        vocab_size=vocab,
        device=torch.device("cpu"),
        capture=False,
        mixed=False,
    )
    blocks = -(-context_tokens // block_size)
    tables = [list(range(i * 4096, i * 4096 + blocks)) for i in range(batch)]
    times_ms = []
    for step in range(steps):
        position = context_tokens + step
        for table in tables:
            if position // block_size >= len(table):
                table.append(table[-1] + 1)
        inputs = StepInputs(
            [1] * batch, [position] * batch, [1] * batch, tables, list(range(batch))
        )
        start_s = time.perf_counter()
        graphs.run(inputs, graphs.shape_for(inputs))
        times_ms.append((time.perf_counter() - start_s) * 1000)
    return statistics.median(times_ms)


def detokenize_us_per_token(model: str, num_tokens: int, stop: list[str]) -> list[dict]:
    """The detokenizer's cost per token along one long output (``num_tokens`` random token
    ids, each added and its delta taken, as the engine does per step), by stretch of the
    output: a cost that grows along it would be paid again for every token."""
    from worker.loader import load_tokenizer
    from worker.tokenizer import IncrementalDetokenizer

    tokenizer = load_tokenizer(model)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 40000) for _ in range(num_tokens)]
    detok = IncrementalDetokenizer(tokenizer, [], stop)
    marks = sorted({min(num_tokens, m) for m in (1000, num_tokens // 4, num_tokens // 2)})
    marks.append(num_tokens)
    rows, done, start_s = [], 0, time.perf_counter()
    for i, token in enumerate(ids, start=1):
        detok.add_token(token)
        detok.take_delta(False)
        if i == marks[len(rows)]:
            now_s = time.perf_counter()
            rows.append(
                {
                    "tokens": f"{done}-{i}",
                    "us_per_token": round((now_s - start_s) / (i - done) * 1e6, 2),
                }
            )
            done, start_s = i, now_s
            if len(rows) == len(marks):
                break
    return rows


def measure(batch: int, steps: int, repeats: int, profile: str, model: str) -> dict:
    row: dict = {"batch": batch, "steps": steps, "repeats": repeats}
    for wait, key in ((True, "host_cpu_ms_per_step"), (False, "no_wait_host_cpu_ms_per_step")):
        runs = [_step_cpu_ms(batch, steps, profile, model, wait) for _ in range(repeats)]
        medians = sorted(statistics.median(run) for run in runs)
        row[f"{key}_p50"] = round(statistics.median(medians), 3)
        row[f"{key}_p50_range"] = [round(medians[0], 3), round(medians[-1], 3)]
        row[f"{key}_p90"] = round(statistics.quantiles(sum(runs, []), n=10)[-1], 3)
    loops = [_loop_cpu_ms(batch, steps, profile, model) for _ in range(repeats)]
    for index, key in ((0, "loop_cpu_ms_per_step"), (1, "message_cpu_ms_per_step")):
        medians = sorted(statistics.median(run[index]) for run in loops)
        row[f"{key}_p50"] = round(statistics.median(medians), 3)
        row[f"{key}_p50_range"] = [round(medians[0], 3), round(medians[-1], 3)]
    row["message_bytes"] = loops[-1][2]
    for overlap, key in (
        (False, "loop_wall_ms_per_step"),
        (True, "overlapped_loop_wall_ms_per_step"),
    ):
        medians = sorted(
            statistics.median(_loop_wall_ms(batch, steps, profile, model, overlap))
            for _ in range(repeats)
        )
        row[f"{key}_p50"] = round(statistics.median(medians), 3)
        row[f"{key}_p50_range"] = [round(medians[0], 3), round(medians[-1], 3)]
    row["host_cpu_us_per_token_p50"] = round(row["host_cpu_ms_per_step_p50"] * 1000 / batch, 1)
    row["no_wait_host_cpu_us_per_token_p50"] = round(
        row["no_wait_host_cpu_ms_per_step_p50"] * 1000 / batch, 1
    )
    context = PROMPT_TOKENS + OUTPUT_TOKENS // 2
    step_s = load_profile(profile).step_seconds(0, batch, batch * context)
    row["device_ms_per_step"] = round(step_s * 1000, 3)
    row["host_over_device"] = round(row["host_cpu_ms_per_step_p50"] / row["device_ms_per_step"], 2)
    return row


def plot(rows: list[dict], profile: str, cpu: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"batch {r['batch']}" for r in rows]
    x = range(len(rows))
    bars = (
        ("host_cpu_ms_per_step", "engine host CPU, device wait slept (p50)", -0.3),
        ("no_wait_host_cpu_ms_per_step", "engine host CPU, no device wait (p50)", -0.1),
    )
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label, shift in bars:
        p50 = [r[f"{key}_p50"] for r in rows]
        low = [r[f"{key}_p50"] - r[f"{key}_p50_range"][0] for r in rows]
        high = [r[f"{key}_p50_range"][1] - r[f"{key}_p50"] for r in rows]
        ax.bar([i + shift for i in x], p50, 0.2, yerr=[low, high], capsize=3, label=label)
    loop_ms = [r["loop_cpu_ms_per_step_p50"] for r in rows]
    ax.bar([i + 0.1 for i in x], loop_ms, 0.2, label="engine process: loop step (p50)")
    ax.bar([i + 0.1 for i in x], [r["message_cpu_ms_per_step_p50"] for r in rows], 0.2,
           bottom=loop_ms, label="engine process: its step message pickled (p50)")  # fmt: skip
    ax.bar([i + 0.3 for i in x], [r["device_ms_per_step"] for r in rows], 0.2,
           label=f"device time ({profile} profile)")  # fmt: skip
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per decode step (bars: range over repeats)")
    ax.set_title(f"Engine host time per decode step\n{cpu}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine_host",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5, help="fresh engines per way and batch")
    parser.add_argument("--profile", default="gpu", help="sim profile (worker/sim_profiles.json)")
    parser.add_argument("--model", default="smollm2", help="its tokenizer and vocabulary")
    parser.add_argument("--tag", default="", help="appended to the result file's name")
    parser.add_argument(
        "--graph-inputs",
        type=int,
        nargs="*",
        metavar="CONTEXT",
        default=None,
        help="instead: time writing a decode step's graph inputs at these contexts (tokens)",
    )
    parser.add_argument(
        "--detokenize",
        type=int,
        metavar="TOKENS",
        default=None,
        help="instead: the detokenizer's us per token along one output of TOKENS tokens",
    )
    parser.add_argument(
        "--one-request",
        type=int,
        metavar="REQUESTS",
        default=None,
        help="instead: REQUESTS lone requests (200-token prompts, 32 tokens) through the engine"
        " loop, overlapped and not, alternated twice: time to the first and the last token",
    )
    args = parser.parse_args(argv)
    if args.one_request is not None:
        for overlap in (False, True, False, True):
            first_ms, total_ms = one_request_ms(overlap, args.one_request, args.profile, args.model)
            print(
                f"overlap {'on ' if overlap else 'off'}: first token {first_ms:.2f} ms,"
                f" last token {total_ms:.1f} ms (medians of {args.one_request})"
            )
        return 0
    if args.detokenize is not None:
        for stop in ([], ["\n\nUser:"]):
            for row in detokenize_us_per_token(args.model, args.detokenize, stop):
                print(
                    f"stop strings {stop}: tokens {row['tokens']}: {row['us_per_token']} us/token"
                )
        return 0
    if args.graph_inputs is not None:
        for context in args.graph_inputs or [160, 2048]:
            for batch in args.batch:
                ms = graph_inputs_ms(batch, context)
                print(f"batch {batch}, context {context}: graph inputs {ms:.3f} ms per step")
        return 0
    rows = []
    for batch in args.batch:
        row = measure(batch, args.steps, args.repeats, args.profile, args.model)
        print(
            f"batch {batch}: host {row['host_cpu_ms_per_step_p50']} CPU-ms/step with the device "
            f"wait slept, {row['no_wait_host_cpu_ms_per_step_p50']} without; device "
            f"{row['device_ms_per_step']} ms/step",
            file=sys.stderr,
        )
        rows.append(row)
    header = result_header("engine_host", "bench.engine_host", argv, "cpu")
    result = {**header, "profile": args.profile, "rows": rows}
    stem = result_stem("engine_host", "cpu", args.tag)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.profile, result["cpu"], stem.with_suffix(".png"))
    print(
        "| batch | host CPU-ms/step p50 (range), wait slept | p90 | no wait p50 (range) | p90 |"
        " us/token slept / no wait | engine process: loop step + message p50 (bytes) |"
        " device ms/step | host/device | loop wall ms/step, wait slept: sequential /"
        " overlapped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        slept, warm = "host_cpu_ms_per_step", "no_wait_host_cpu_ms_per_step"
        print(
            f"| {r['batch']} | {r[slept + '_p50']} ({r[slept + '_p50_range'][0]}-"
            f"{r[slept + '_p50_range'][1]}) | {r[slept + '_p90']} | {r[warm + '_p50']} "
            f"({r[warm + '_p50_range'][0]}-{r[warm + '_p50_range'][1]}) | {r[warm + '_p90']} |"
            f" {r['host_cpu_us_per_token_p50']} / {r['no_wait_host_cpu_us_per_token_p50']} |"
            f" {r['loop_cpu_ms_per_step_p50']} + {r['message_cpu_ms_per_step_p50']}"
            f" ({r['message_bytes']}) | {r['device_ms_per_step']} | {r['host_over_device']} |"
            f" {r['loop_wall_ms_per_step_p50']} / {r['overlapped_loop_wall_ms_per_step_p50']} |"
        )
    print(f"wrote {stem}.json and .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
