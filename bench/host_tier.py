"""TTFT of a request whose long prefix is cached on the device, on the host tier, or nowhere.

One engine with a host KV tier. A 2k-token prefix is computed once; then the same prefix plus
a new question is timed three ways: straight after (a device-tier hit), after filler
requests pushed the prefix out of the deliberately small device pool (a host-tier hit: the
blocks are copied back), and on an engine without prefix caching (recomputed). Greedy
outputs of the three are checked equal (the determinism contract).

    python -m bench.host_tier                       # CPU: both tiers are RAM (informational)
    python -m bench.host_tier --device cuda         # the measurement that matters (H100/H200)

Writes ``bench/results/host_tier_<device>_<date>.json`` and a PNG.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench.result_files import result_header, result_stem


def timed_ttft(engine, prompt: list[int], rid: str) -> tuple[float, list[int], int]:
    from worker.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft_s, tokens, cached = None, [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if ttft_s is None and out.token_ids:
                ttft_s = time.perf_counter() - t0
            if out.finished:
                tokens, cached = out.token_ids, out.num_cached_tokens
    if engine.config.device.startswith("cuda"):
        torch.cuda.synchronize()
    return ttft_s, tokens, cached


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from worker.config import EngineConfig
    from worker.engine import LLMEngine

    rng = random.Random(0)
    prefix_blocks = args.prefix_tokens // 16
    common = dict(
        model=args.model,
        device=args.device,
        max_num_batched_tokens=args.prefix_tokens + 64,
        max_model_len=max(4096, args.prefix_tokens + 128),
    )
    recompute_engine = LLMEngine(
        EngineConfig(**common, num_kv_blocks=prefix_blocks + 40, enable_prefix_caching=False)
    )
    per_block = recompute_engine.runner.bytes_per_block
    # The device pool holds one long prompt and little more, so filler evicts the prefix;
    # the host tier holds two.
    engine = LLMEngine(
        EngineConfig(
            **common,
            num_kv_blocks=prefix_blocks + 40,
            host_kv_cache_bytes=per_block * (prefix_blocks + 64) * 2,
        )
    )
    vocab = engine.spec.vocab_size
    rows = {"device_hit": [], "host_hit": [], "recompute": []}
    outputs = {}
    for rep in range(args.repeats):
        prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]

        def question():
            return [rng.randrange(100, vocab) for _ in range(16)]

        timed_ttft(engine, prefix + question(), f"warm{rep}")
        t, toks, cached = timed_ttft(engine, prefix + question(), f"dev{rep}")
        rows["device_hit"].append((t, cached))
        for i in range(2):  # filler: pushes the prefix to the host tier
            timed_ttft(
                engine,
                [rng.randrange(100, vocab) for _ in range(args.prefix_tokens)],
                f"fill{rep}-{i}",
            )
        q = question()
        loaded_before = engine.pool.host.counters.blocks_loaded
        t, toks_host, cached = timed_ttft(engine, prefix + q, f"host{rep}")
        if engine.pool.host.counters.blocks_loaded == loaded_before:
            raise RuntimeError(
                "the prefix did not come back from the host tier: raise --prefix-tokens or shrink "
                "the pool"
            )
        rows["host_hit"].append((t, cached))
        t, toks_re, _ = timed_ttft(recompute_engine, prefix + q, f"re{rep}")
        rows["recompute"].append((t, 0))
        outputs[rep] = toks_host == toks_re
    table = {
        k: {"ttft_s_median": sorted(x[0] for x in v)[len(v) // 2], "cached_tokens": v[-1][1]}
        for k, v in rows.items()
    }
    ratio = table["host_hit"]["ttft_s_median"] / table["recompute"]["ttft_s_median"]
    print(f"{'path':12s} {'TTFT median s':>14s} {'cached tokens':>14s}")
    for k, v in table.items():
        print(f"{k:12s} {v['ttft_s_median']:14.3f} {v['cached_tokens']:14d}")
    print(
        f"host hit / recompute = {ratio:.2f} (target on H100/H200: <= 0.30); "
        f"outputs equal: {all(outputs.values())}"
    )
    result = {
        **result_header("host_tier", "bench.host_tier", argv, args.device),
        "prefix_tokens": args.prefix_tokens,
        "repeats": args.repeats,
        "table": table,
        "host_over_recompute": round(ratio, 3),
        "outputs_equal": all(outputs.values()),
    }
    stem = result_stem("host_tier", args.device)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(table)
    ax.barh(
        names, [table[n]["ttft_s_median"] for n in names], color=["#2b7bba", "#6baed6", "#999999"]
    )
    ax.set_xlabel("time to first token, s (median)")
    ax.set_title(f"{args.prefix_tokens}-token prefix on {result['device']}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
