"""How long a busy replica takes to answer a peer's KV export (the served pull).

A pull's first half is the holder's answer. The holder is the replica the router avoided
because it is busy, and its engine steps for up to seconds on a CPU (a 512-token prefill
chunk). This measures that answer where the replica makes it: an ``AsyncEngine`` whose engine
runs in its own process (as in a served replica), holding a prefix, while it serves a long
request (a chunked prefill, then decode). Every ``--interval-s`` it is asked for the prefix
(``AsyncEngine.export_prefix``: 496 tokens of SmolLM2, 23 MB); each answer's latency is
recorded with the phase the busy request was in (prefill until its first token, then decode).

    python -m bench.experiments.kv_export_busy          # SmolLM2, 1 thread, 496-token prefix
    python -m bench.experiments.kv_export_busy --quick  # smoke: a short busy request

Writes ``bench/results/kv_export_busy_cpu_<date>.json`` with the load average at the start and
the end: on a shared machine the numbers are indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

from bench.common import percentile
from bench.result_files import result_header, result_stem

TOKEN_RANGE = (1000, 40000)  # ordinary SmolLM2 words, clear of the special tokens


def _summary(latencies_s: list[float]) -> dict:
    if not latencies_s:
        return {"count": 0}
    return {
        "count": len(latencies_s),
        "median_s": statistics.median(latencies_s),
        "p90_s": percentile(latencies_s, 90),
        "max_s": max(latencies_s),
    }


async def measure(args) -> dict:
    from router.protocol import hash_blocks
    from worker.async_engine import AsyncEngine
    from worker.config import EngineConfig
    from worker.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    engine = AsyncEngine(EngineConfig(model=args.model, num_threads=args.threads), "holder")
    try:
        prefix = [rng.randrange(*TOKEN_RANGE) for _ in range(args.prefix_tokens + 1)]
        [_ async for _ in engine.generate("cold", prefix, SamplingParams(max_tokens=1))]
        num_blocks = args.prefix_tokens // engine.block_size
        hashes = hash_blocks(prefix, engine.block_size, engine.cache_namespace, None)[:num_blocks]
        tokens = prefix[: num_blocks * engine.block_size]
        for _ in range(args.warmup):  # the first answers allocate their buffers
            await engine.export_prefix(hashes, tokens)

        busy = [rng.randrange(*TOKEN_RANGE) for _ in range(args.busy_prompt_tokens)]
        params = SamplingParams(max_tokens=args.busy_output_tokens, ignore_eos=True)
        first_token_s: list[float] = []

        async def serve_busy() -> None:
            async for _ in engine.generate("busy", busy, params):
                if not first_token_s:
                    first_token_s.append(time.perf_counter())

        busy_task = asyncio.create_task(serve_busy())
        samples = []
        await asyncio.sleep(args.interval_s)
        while not busy_task.done():
            start_s = time.perf_counter()
            payload = await engine.export_prefix(hashes, tokens)
            latency_s = time.perf_counter() - start_s
            assert payload is not None and payload.num_blocks == num_blocks
            phase = "decode" if first_token_s and first_token_s[0] < start_s else "prefill"
            samples.append({"phase": phase, "latency_s": latency_s})
            print(f"  {phase:7s} export answered in {latency_s * 1000:7.1f} ms", flush=True)
            await asyncio.sleep(args.interval_s)
        await busy_task
    finally:
        await engine.shutdown(1.0)
    by_phase = {
        phase: _summary([s["latency_s"] for s in samples if s["phase"] == phase])
        for phase in ("prefill", "decode")
    }
    return {
        "samples": samples,
        "summary": by_phase,
        "payload_bytes": payload.kv_bytes,
    }


def plot(samples: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for phase, color in (("prefill", "tab:orange"), ("decode", "tab:blue")):
        points = [(i, s["latency_s"] * 1000) for i, s in enumerate(samples) if s["phase"] == phase]
        if points:
            ax.scatter(*zip(*points, strict=True), label=f"holder in {phase}", color=color, s=18)
    ax.set_xlabel("export request (one every interval)")
    ax.set_ylabel("answer latency (ms)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1, help="the holder engine's threads")
    parser.add_argument("--prefix-tokens", type=int, default=496)
    parser.add_argument("--busy-prompt-tokens", type=int, default=2048)
    parser.add_argument("--busy-output-tokens", type=int, default=48)
    parser.add_argument("--interval-s", type=float, default=0.25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short busy request")
    parser.add_argument("--suffix", default="", help="appended to the result files' names")
    args = parser.parse_args(argv)
    if args.quick:
        args.busy_prompt_tokens, args.busy_output_tokens = 600, 8
    load_start = os.getloadavg()
    print(
        f"holder busy with {args.busy_prompt_tokens} prompt + {args.busy_output_tokens} output "
        f"tokens; a {args.prefix_tokens}-token export every {args.interval_s} s"
    )
    result = asyncio.run(measure(args))
    out = {
        **result_header("kv_export_busy", "bench.experiments.kv_export_busy", argv, "cpu"),
        "load_average_1_5_15_start": list(load_start),
        "load_average_1_5_15_end": list(os.getloadavg()),
        "args": vars(args),
        **result,
    }
    stem = str(result_stem("kv_export_busy", "cpu", args.suffix))
    with open(stem + ".json", "w") as f:
        json.dump(out, f, indent=2)
    plot(
        result["samples"],
        stem + ".png",
        f"export of {args.prefix_tokens} tokens ({result['payload_bytes'] / 1e6:.0f} MB) from an "
        f"engine process serving {args.busy_prompt_tokens} + {args.busy_output_tokens} tokens",
    )
    print(json.dumps(result["summary"], indent=2), stem + ".json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
