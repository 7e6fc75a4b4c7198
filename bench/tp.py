"""Latency at tensor-parallel degrees 1, 2 and 3: TTFT and per-token decode, one engine each.

Each degree gets a fresh engine (rank 0 here, ranks 1..N-1 as local processes) with the
machine's cores split between its ranks (``--num-threads`` in all, so TP = 1 uses them all).
Per degree: TTFT of single prompts of ``--prompt-tokens`` tokens (prefix caching off, so
every prompt is computed), then decode latency per step at batch 1 and batch 8. Greedy tokens
are compared with TP = 1 (the same tokens are expected; the bits may differ by degree).

On a CPU this is informational: the ranks share the same few cores and memory bandwidth,
so TP adds communication without adding compute. On a GPU machine (one GPU per rank) it is
the measurement that matters.

    python -m bench.tp                          # CPU, TP = 1, 2, 3 on SmolLM2 (2 skipped: 9 heads)
    python -m bench.tp --random-llama-heads 8   # a random SmolLM2-sized Llama with 8 heads
    python -m bench.tp --device cuda --tp 1 2   # needs 2 GPUs

Writes ``bench/results/tp_<device>_<date>[_random<H>h]_<T>threads.json`` and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from bench.result_files import result_header, result_stem


def _run_until_done(engine, first_token_at: dict) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in first_token_at:
                first_token_at[out.request_id] = time.perf_counter()
            if out.finished:
                done[out.request_id] = out
    return done


def measure(engine, prompts: list[list[int]], decode_tokens: int, batch: int) -> dict:
    from worker.sampling_params import SamplingParams

    ttfts_s = []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(
            f"ttft{i}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        )
        _run_until_done(engine, {})
        ttfts_s.append(time.perf_counter() - t0)
    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    per_token_s = {}
    tokens = None
    for size in (1, batch):
        for j in range(size):
            engine.add_request(f"dec{size}-{j}", prompts[j % len(prompts)][:64], params)
        first: dict = {}
        done = _run_until_done(engine, first)
        end = time.perf_counter()
        start = max(first.values())  # every sequence prefilled: what follows is decode only
        per_token_s[size] = (end - start) / (decode_tokens - 1)
        if size == 1:
            tokens = done["dec1-0"].outputs[0].token_ids
    return {
        "ttft_s_median": statistics.median(ttfts_s),
        "ttft_s": ttfts_s,
        "decode_s_per_token": {str(k): v for k, v in per_token_s.items()},
        "tokens": tokens,
    }


def random_llama(folder: Path, num_heads: int) -> str:
    """A random-weight Llama shaped like SmolLM2-135M (30 layers, 64-dim heads, intermediate
    1536, vocabulary 49152) but with ``num_heads`` heads (half as many KV heads), so degrees
    SmolLM2's 9 heads do not allow can be timed on a model of the same cost."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.loader import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    for f in Path(resolve_model("smollm2").path).iterdir():
        if f.name.startswith("tokenizer") or f.name in (
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            shutil.copy(f, folder / f.name)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64 * num_heads,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--random-llama-heads",
        type=int,
        default=None,
        help="time a random SmolLM2-sized Llama with this many heads instead of --model",
    )
    args = ap.parse_args(argv)
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.parallel.sharding import ShardPlan, read_spec

    model, model_name = args.model, args.model
    if args.random_llama_heads:
        import tempfile

        model = random_llama(
            Path(tempfile.mkdtemp(prefix="bench-tp-")) / "llama", args.random_llama_heads
        )
        model_name = f"random Llama, SmolLM2 size, {args.random_llama_heads} heads"
    from worker.loader import resolve_model

    spec = read_spec(resolve_model(model).path)
    skipped = {}

    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)
    ]
    rows = {}
    for tp in args.tp:
        try:
            ShardPlan.make(spec, 0, tp)
        except ValueError as exc:
            skipped[tp] = str(exc)
            print(f"TP={tp}: skipped ({exc})", flush=True)
            continue
        t0 = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                model=model,
                device=args.device,
                tensor_parallel_size=tp,
                num_threads=args.num_threads,
                enable_prefix_caching=False,
                num_kv_blocks=256,
                max_num_batched_tokens=max(512, args.prompt_tokens),
            )
        )
        start_s = time.perf_counter() - t0
        try:
            measure(engine, prompts[:1], 4, 1)  # warm-up: first calls allocate and page in
            rows[tp] = {
                "start_s": start_s,
                **measure(engine, prompts, args.decode_tokens, args.batch),
            }
        finally:
            engine.shutdown()
        r = rows[tp]
        print(
            f"TP={tp}: start {start_s:.1f}s, TTFT {r['ttft_s_median']:.3f}s, decode "
            + ", ".join(
                f"batch {k}: {v * 1e3:.1f} ms/token" for k, v in r["decode_s_per_token"].items()
            ),
            flush=True,
        )
    base = rows[args.tp[0]]["tokens"]
    same = {tp: r.pop("tokens") == base for tp, r in rows.items()}
    print(f"greedy tokens equal to TP={args.tp[0]}: {same}")
    result = {
        **result_header("tp", "bench.tp", argv, args.device),
        "cores": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "model": model_name,
        "skipped": {str(k): v for k, v in skipped.items()},
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "num_threads_total": args.num_threads,
        "rows": {str(k): v for k, v in rows.items()},
        "greedy_tokens_equal": {str(k): v for k, v in same.items()},
    }
    suffix = (
        f"_random{args.random_llama_heads}h" if args.random_llama_heads else ""
    ) + f"_{args.num_threads}threads"
    stem = result_stem("tp", args.device, suffix)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    names = [f"TP={tp}" for tp in rows]
    axes[0].bar(names, [r["ttft_s_median"] for r in rows.values()], color="#2b7bba")
    axes[0].set_ylabel(f"TTFT, s ({args.prompt_tokens}-token prompt)")
    for k, color in (("1", "#6baed6"), (str(args.batch), "#08519c")):
        axes[1].plot(
            names,
            [r["decode_s_per_token"][k] * 1e3 for r in rows.values()],
            "o-",
            color=color,
            label=f"batch {k}",
        )
    axes[1].set_ylabel("decode, ms per step")
    axes[1].legend()
    fig.suptitle(f"{model_name}, tensor parallel on {result['device']} ({os.cpu_count()} cores)")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
