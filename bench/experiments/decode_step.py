"""One decode step of the engine benchmark's workload, timed and profiled in isolation.

Starts ``LLMEngine`` on SmolLM2 with ``--max-num-seqs`` sequences of ``bench/engine.py``'s
workload (system prompts of 300-500 tokens shared by every fourth request), steps it until
every sequence decodes, then re-runs that one decode step's forward pass (the model runner's
``run_inputs``: same tokens, same KV slots, so every repeat does the same work) and reports the
minimum and median wall time (and the minimum CPU time: with one thread, the number least
disturbed by other processes); ``--breakdown`` adds each kernel's share (linear, attention,
norms, rotary, KV store), ``--profile`` torch.profiler's table of the ops that dominate. On a
shared machine the minimum is the number to compare; run A and B back to back.

    python -m bench.experiments.decode_step --max-num-seqs 8 --threads 2 --repeats 20
    python -m bench.experiments.decode_step --max-num-seqs 8 --threads 2 --breakdown --profile
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch


def _print_breakdown(runner, inputs, repeats: int) -> None:
    """Wraps each kernel of the model's backend in a timer; prints each one's per-step total
    (the minimum over the repeats)."""
    model = runner.model
    backend = model.ops
    spent: dict[str, float] = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return out

        return call

    names = ("linear", "rms_norm", "rotary", "store_kv", "attention")
    model.ops = dataclasses.replace(backend, **{n: timed(n, getattr(backend, n)) for n in names})
    best: dict[str, float] = {}
    try:
        for _ in range(repeats):
            spent.clear()
            t0 = time.perf_counter()
            runner.run_inputs(inputs)
            spent["(forward)"] = time.perf_counter() - t0
            for name, s in spent.items():
                best[name] = min(best.get(name, s), s)
    finally:
        model.ops = backend
    for name, s in sorted(best.items(), key=lambda kv: -kv[1]):
        print(f"  {name:12s} {s * 1e3:7.1f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--decode-steps", type=int, default=4, help="decode steps to run before the timed one"
    )
    ap.add_argument(
        "--profile", action="store_true", help="print torch.profiler's top ops of a few repeats"
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="time each kernel of the backend (minimum per repeat)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from bench.engine import make_workload
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.loader import resolve_model
    from worker.sampling_params import SamplingParams
    from worker.tokenizer import Tokenizer

    prompts = make_workload(Tokenizer(resolve_model("smollm2").path), args.max_num_seqs)
    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model="smollm2",
            num_kv_blocks=1024,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=512,
        )
    )
    print(f"engine start {time.perf_counter() - t0:.1f} s")
    params = SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    runner = engine.runner
    captured = []
    original = runner.run_inputs

    def capture(inputs):
        captured.append(inputs)
        return original(inputs)

    runner.run_inputs = capture
    decodes = 0
    while decodes < args.decode_steps:
        captured.clear()
        engine.step()
        if (
            captured
            and len(captured[-1].counts) == args.max_num_seqs
            and set(captured[-1].counts) == {1}
        ):
            decodes += 1
    runner.run_inputs = original
    inputs = captured[-1]
    print(
        f"decode step: {len(inputs.counts)} sequences, context "
        f"{min(inputs.starts) + 1}-{max(inputs.starts) + 1} tokens"
    )

    times_ms, cpu_ms = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        runner.run_inputs(inputs)
        times_ms.append((time.perf_counter() - t0) * 1e3)
        cpu_ms.append((time.process_time() - c0) * 1e3)
    print(
        f"forward: min {min(times_ms):.1f} ms  median {statistics.median(times_ms):.1f} ms  "
        f"(CPU time min {min(cpu_ms):.1f} ms; {args.repeats} repeats, {args.threads} threads)"
    )
    if args.breakdown:
        _print_breakdown(runner, inputs, args.repeats)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                runner.run_inputs(inputs)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
