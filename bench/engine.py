"""Offline engine benchmark: shared system prompts, ours (deterministic and fast) vs transformers.

Workload: 64 requests, 4 system prompts of 300-500 tokens, a distinct question
each, 64 greedy output tokens (EOS ignored so every system does the same work). All requests
are submitted at t=0. Each system runs in its own fresh Python process. Reported per
system: output tokens/s, total time, TTFT mean/p50/p99.

transformers runs ``generate`` with static batches (left padding, its KV cache) at each batch
size given; its best is the baseline. Its TTFT for a request is the end of the prefill of
that request's batch (recorded by a logits processor), counted from t=0.

    python -m bench.engine                 # full run, writes bench/results/engine_<date>.json/.png
    python -m bench.engine --quick         # 16 requests, 16 tokens: a smoke run
    # one system, small batches:
    python -m bench.engine --only deterministic --max-num-seqs 8 --threads 2
    # our engine with an 8-bit KV cache (int8 or fp8_e4m3; transformers is unchanged):
    python -m bench.engine --kv-cache-dtype int8 --skip-transformers
    # every request sampled (a seed each; transformers samples too):
    python -m bench.engine --temperature 0.7 --top-p 0.9 --skip-transformers
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.common import percentile
from kernels.kv_quant import KV_CACHE_DTYPES

RESULTS = Path(__file__).parent / "results"
TOPICS = ["a travel agency", "a bank's support desk", "a chemistry tutor", "a software help desk"]


def make_workload(tokenizer, num_requests: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = []
    for i, topic in enumerate(TOPICS):
        target = rng.randint(300, 500)
        rules = " ".join(
            f"Rule {j}: as {topic}, answer item {j} with care, cite policy {i}-{j}."
            for j in range(80)
        )
        systems.append(tokenizer.encode(f"You are the assistant of {topic}. {rules}")[:target])
    prompts = []
    for r in range(num_requests):
        question = tokenizer.encode(
            f"\nUser {r} asks: what should I do about case number "
            f"{rng.randint(1000, 9999)}?\nAssistant:"
        )
        prompts.append(systems[r % len(systems)] + question)
    return prompts


def run_ours(
    prompts,
    max_tokens: int,
    deterministic: bool,
    max_num_seqs: int = 64,
    *,
    model: str = "smollm2",
    enforce_eager: bool = False,
    kv_cache_dtype: str = "auto",
    overlap_outputs: str = "auto",
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict:
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=model,
            num_kv_blocks=4096,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=512,
            deterministic=deterministic,
            enforce_eager=enforce_eager,
            kv_cache_dtype=kv_cache_dtype,
            overlap_outputs=overlap_outputs,
        )
    )
    t0 = time.monotonic()
    for i, p in enumerate(prompts):
        params = SamplingParams(
            temperature=temperature, top_p=top_p, seed=i, max_tokens=max_tokens, ignore_eos=True
        )
        engine.add_request(f"r{i}", p, params)
    ttft, outs = {}, {}
    for outputs in engine.steps():
        for out in outputs:
            if out.request_id not in ttft and out.token_ids:
                ttft[out.request_id] = time.monotonic() - t0
            if out.finished:
                outs[out.request_id] = out
    total_s = time.monotonic() - t0
    cached = sum(o.num_cached_tokens for o in outs.values())
    kv = "" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} KV"
    return _summary(
        f"prefixserve ({'deterministic' if deterministic else 'fast'}{kv})",
        total_s,
        sum(len(o.token_ids) for o in outs.values()),
        list(ttft.values()),
        cached_ratio=cached / sum(len(p) for p in prompts),
    )


def run_transformers(
    prompts, max_tokens: int, batch_size: int, path: str, temperature: float = 0.0, top_p=1.0
) -> dict:
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    class FirstCall(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            self.t = self.t or time.monotonic()
            return scores

    t0 = time.monotonic()
    ttft, generated = [], 0
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b : b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        probe = FirstCall()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=temperature > 0,
                **({"temperature": temperature, "top_p": top_p} if temperature > 0 else {}),
                pad_token_id=0,
                logits_processor=LogitsProcessorList([probe]),
            )
        ttft += [probe.t - t0] * len(batch)
        generated += (out.shape[1] - width) * len(batch)
    return _summary(
        f"transformers generate (batch {batch_size})", time.monotonic() - t0, generated, ttft
    )


ROW_PREFIX = "ROW "
TARGET_SPEEDUP = 3.0


def _run_isolated(system: str, argv: list[str]) -> dict:
    """Runs one system in a fresh interpreter, so none inherits another's heap, caches or
    thread pool (measured: transformers ran 10% slower after our engine in one process)."""
    cmd = [sys.executable, "-m", "bench.engine", *argv, "--only", system]
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    rows = [
        line[len(ROW_PREFIX) :] for line in proc.stdout.splitlines() if line.startswith(ROW_PREFIX)
    ]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(
            f"{system}: the child run failed (exit {proc.returncode}); its stderr is above"
        )
    print(proc.stdout.replace(ROW_PREFIX + rows[-1], "").rstrip(), flush=True)
    return json.loads(rows[-1])


def _summary(name: str, total_s: float, tokens: int, ttft_s: list[float], **extra) -> dict:
    row = {
        "system": name,
        "total_s": round(total_s, 2),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / total_s, 2),
        "ttft_mean_s": round(sum(ttft_s) / len(ttft_s), 3),
        "ttft_p50_s": round(percentile(ttft_s, 50), 3),
        "ttft_p99_s": round(percentile(ttft_s, 99), 3),
        **extra,
    }
    print(
        f"  {name:42s} {row['output_tokens_per_s']:8.1f} tok/s  total {total_s:7.1f}s  "
        f"TTFT p50 {row['ttft_p50_s']:.2f}s p99 {row['ttft_p99_s']:.2f}s",
        flush=True,
    )
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["system"].replace(" (", "\n(") for r in rows]
    colors = ["#2b7bba" if r["system"].startswith("prefixserve") else "#999999" for r in rows]
    a.barh(names, [r["output_tokens_per_s"] for r in rows], color=colors)
    hf = [r["output_tokens_per_s"] for r in rows if r["system"].startswith("transformers")]
    if hf:  # the target: 3x the best static batch of transformers
        a.axvline(
            TARGET_SPEEDUP * max(hf),
            color="#c0392b",
            linestyle="--",
            label=f"target: {TARGET_SPEEDUP:g}x best transformers",
        )
        a.legend(loc="lower right")
    for y, r in enumerate(rows):
        a.annotate(f" {r['output_tokens_per_s']:.1f}", (r["output_tokens_per_s"], y), va="center")
    a.set_xlim(
        0,
        1.2 * max([r["output_tokens_per_s"] for r in rows] + [TARGET_SPEEDUP * max(hf, default=0)]),
    )
    a.set_xlabel("output tokens/s (higher is better)")
    b.barh(names, [r["ttft_p50_s"] for r in rows], color=colors, label="p50")
    b.barh(
        names,
        [r["ttft_p99_s"] - r["ttft_p50_s"] for r in rows],
        left=[r["ttft_p50_s"] for r in rows],
        color=colors,
        alpha=0.35,
        label="p99",
    )
    b.set_xlabel("time to first token, s (lower is better)")
    b.legend()
    for ax in (a, b):
        ax.invert_yaxis()
    fig.suptitle("64 requests sharing 4 system prompts, 64 greedy tokens each (SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--hf-batch-sizes", default="16,64", help="static batch sizes to try for transformers"
    )
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--quick", action="store_true", help="16 requests x 16 tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument(
        "--max-num-seqs", type=int, default=64, help="our engine's running-batch cap (default 64)"
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="our engine's KV cache format (EngineConfig.kv_cache_dtype; default auto)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample every request at this temperature (a seed each; default 0: greedy)",
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p")
    ap.add_argument(
        "--only", default=None, help=argparse.SUPPRESS
    )  # one system, in a child process
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_tokens, args.hf_batch_sizes = 16, 16, "16"
    if args.threads:
        torch.set_num_threads(args.threads)
    from worker.loader import resolve_model
    from worker.tokenizer import Tokenizer

    path = resolve_model("smollm2").path
    prompts = make_workload(Tokenizer(path), args.num_requests)
    print(
        f"workload: {len(prompts)} requests, prompt tokens "
        f"{min(map(len, prompts))}-{max(map(len, prompts))}, "
        f"{args.max_tokens} output tokens, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    if args.only:  # child: run one system, hand its row back on the last line
        kind, _, batch = args.only.partition(":")
        if kind == "transformers":
            row = run_transformers(
                prompts, args.max_tokens, int(batch), path, args.temperature, args.top_p
            )
        else:
            row = run_ours(
                prompts,
                args.max_tokens,
                kind == "deterministic",
                args.max_num_seqs,
                kv_cache_dtype=args.kv_cache_dtype,
                temperature=args.temperature,
                top_p=args.top_p,
            )
        print(ROW_PREFIX + json.dumps(row), flush=True)
        return 0
    systems = ["deterministic", "fast"]
    if not args.skip_transformers:
        systems += [f"transformers:{b}" for b in args.hf_batch_sizes.split(",")]
    rows = [_run_isolated(system, argv if argv is not None else sys.argv[1:]) for system in systems]
    hf = [r for r in rows if r["system"].startswith("transformers")]
    det, fast = rows[0]["output_tokens_per_s"], rows[1]["output_tokens_per_s"]
    summary = {"deterministic_vs_fast_slowdown": round(1 - det / fast, 3)}
    if hf:
        best = max(r["output_tokens_per_s"] for r in hf)
        summary["speedup_vs_best_transformers"] = round(det / best, 2)
    print(json.dumps(summary))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = {
        "benchmark": "engine",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m bench.engine " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "workload": {
            "num_requests": len(prompts),
            "max_tokens": args.max_tokens,
            "prompt_tokens_total": sum(map(len, prompts)),
            "kv_cache_dtype": args.kv_cache_dtype,
            "temperature": args.temperature,
            "top_p": args.top_p,
        },
        "rows": rows,
        "summary": summary,
    }
    suffix = "_quick" if args.quick else ""
    if args.kv_cache_dtype != "auto":
        suffix += f"_kv-{args.kv_cache_dtype}"
    if args.temperature > 0:
        suffix += f"_t{args.temperature:g}_p{args.top_p:g}"
    (RESULTS / f"engine_{stamp}{suffix}.json").write_text(json.dumps(out, indent=2))
    plot(rows, RESULTS / f"engine_{stamp}{suffix}.png")
    print(f"wrote {RESULTS / f'engine_{stamp}{suffix}.json'} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
