"""The engine's own host time per decode step, measured with the simulated engine.

    python -m bench.engine_host [--batch 64 256] [--steps 100] [--profile gpu] [--out-dir DIR]

With ``engine="sim"`` the forward pass is a wait (``worker/sim_runner.py``), so the CPU time a
step takes (``time.process_time``, which a wait does not advance) is the engine's host work
alone: scheduling, input preparation, sampling, stop checks and detokenizing, building the
outputs. Per batch size: ``batch`` requests of 32-token prompts, 128 greedy output tokens
with EOS ignored, all admitted and past their prefill before the measured steps; then
``--steps`` decode steps, each timed on its own. Reports the median and p90 CPU-ms per step
and CPU-us per token, beside the profile's own step time (the device time a GPU would take),
and writes ``bench/results/engine_host_cpu_<UTC date><--tag>.json`` and a ``.png`` of host
against device time per step.

A GPU engine whose host time per step exceeds its device time idles the GPU: the ratio in
the table says how far this engine is from keeping the profile's device busy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from bench.result_files import result_header, result_stem
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 128


def measure(batch: int, steps: int, profile: str, model: str) -> dict:
    config = EngineConfig(
        model=model,
        engine="sim",
        sim_profile=profile,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * PROMPT_TOKENS),
        device="cpu",
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0)
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_computed_tokens < PROMPT_TOKENS for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # admission and prefill, not measured
    steps = min(steps, OUTPUT_TOKENS - 2)
    cpu_ms = []
    for _ in range(steps):
        start_s = time.process_time()
        engine.step()
        cpu_ms.append((time.process_time() - start_s) * 1000)
    running = len(engine.scheduler.running)
    context = PROMPT_TOKENS + OUTPUT_TOKENS // 2
    device_ms = engine.runner.profile.step_seconds(0, running, running * context) * 1000
    median_ms = statistics.median(cpu_ms)
    return {
        "batch": batch,
        "steps": steps,
        "host_cpu_ms_per_step_p50": round(median_ms, 3),
        "host_cpu_ms_per_step_p90": round(statistics.quantiles(cpu_ms, n=10)[-1], 3),
        "host_cpu_us_per_token_p50": round(median_ms * 1000 / batch, 1),
        "device_ms_per_step": round(device_ms, 3),
        "host_over_device": round(median_ms / device_ms, 2),
    }


def plot(rows: list[dict], profile: str, cpu: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"batch {r['batch']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [r["host_cpu_ms_per_step_p50"] for r in rows], 0.4,
           label="engine host CPU (p50)")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [r["device_ms_per_step"] for r in rows], 0.4,
           label=f"device time ({profile} profile)")  # fmt: skip
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Engine host time per decode step\n{cpu}", fontsize=9)
    ax.legend()
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
    parser.add_argument("--profile", default="gpu", help="sim profile (worker/sim_profiles.json)")
    parser.add_argument("--model", default="smollm2", help="its tokenizer and vocabulary")
    parser.add_argument("--tag", default="", help="appended to the result file's name")
    args = parser.parse_args(argv)
    rows = []
    for batch in args.batch:
        row = measure(batch, args.steps, args.profile, args.model)
        print(
            f"batch {batch}: host {row['host_cpu_ms_per_step_p50']} CPU-ms/step "
            f"({row['host_cpu_us_per_token_p50']} us/token), device "
            f"{row['device_ms_per_step']} ms/step",
            file=sys.stderr,
        )
        rows.append(row)
    header = result_header("engine_host", "bench.engine_host", argv, "cpu")
    result = {**header, "profile": args.profile, "rows": rows}
    stem = result_stem("engine_host", "cpu", args.tag)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.profile, result["cpu"], stem.with_suffix(".png"))
    print("| batch | host CPU-ms/step p50 | p90 | us/token | device ms/step | host/device |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['host_cpu_ms_per_step_p50']} | {r['host_cpu_ms_per_step_p90']}"
            f" | {r['host_cpu_us_per_token_p50']} | {r['device_ms_per_step']} |"
            f" {r['host_over_device']} |"
        )
    print(f"wrote {stem}.json and .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
