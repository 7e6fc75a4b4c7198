"""What pulling a prefix's KV from a peer replica costs against prefilling it.

Two engines in this process stand for two replicas. Engine A prefills a fresh prefix (timed:
the prefill a pull would save); then the engine-side pull is timed step by step: A's
``export_prefix``, ``pickle.dumps`` (what Ray's object store or an actor reply does),
``pickle.loads`` and B's ``import_prefix``. B then serves the prefix plus a question: its
TTFT with the pulled blocks, its ``num_cached_tokens``, and its greedy tokens, checked equal to
A's local hit on the same prompt (the determinism contract). The network between two Ray
nodes is not in this number: add ``payload bytes / link bandwidth`` for it.

The transfer rate it publishes is ``pulled tokens / (export + pickle + unpickle + import)``, in
tokens per second: what a router would divide remote tokens by (``router/prefix_policy.py``).
``prefill_s`` is the cold TTFT of the prefix plus a 16-token question (one step with sampling);
``prefill_tokens_per_s`` counts the prefix tokens only, so it understates the prefill rate a bit.

    python -m bench.kv_pull                     # SmolLM2, 500-token prefix, 3 repeats (CPU)
    python -m bench.kv_pull --quick             # smoke: one 64-token prefix
    python -m bench.kv_pull --device cuda       # on a GPU (the copies cross PCIe twice)

Writes ``bench/results/kv_pull_<cpu|cuda>_<date>.json`` with the machine's load average at the
start and at the end: on a shared machine the numbers are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import time

import torch

from bench.result_files import result_header, result_stem


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_request(engine, prompt: list[int], rid: str) -> tuple[float, list[int], int]:
    """(TTFT in seconds, greedy tokens, num_cached_tokens) of one request run alone."""
    from worker.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    ttft_s, tokens, cached = None, [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if ttft_s is None and out.token_ids:
                _sync(engine.config.device)
                ttft_s = time.perf_counter() - t0
            if out.finished:
                tokens, cached = out.token_ids, out.num_cached_tokens
    return ttft_s, tokens, cached


def one_pull(a, b, prefix: list[int], question: list[int], rep: int, device: str) -> dict:
    from router.protocol import hash_blocks

    prefill_s, _, _ = run_request(a, prefix + question, f"a-cold{rep}")
    hashes = hash_blocks(prefix, a.block_size, a.cache_namespace, None)
    t0 = time.perf_counter()
    payload = a.export_prefix(hashes, prefix)
    t1 = time.perf_counter()
    blob = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    t2 = time.perf_counter()
    received = pickle.loads(blob)
    t3 = time.perf_counter()
    imported = b.import_prefix(received)
    _sync(device)
    t4 = time.perf_counter()
    if payload is None or imported != len(hashes):
        raise RuntimeError(
            f"pulled {imported} of {len(hashes)} blocks: give engine B more KV blocks"
        )
    q2 = [t + 1 for t in question]
    hit_ttft_s, tokens_b, cached_b = run_request(b, prefix + q2, f"b-pulled{rep}")
    local_ttft_s, tokens_a, cached_a = run_request(a, prefix + q2, f"a-local{rep}")
    pull_s = t4 - t0
    return {
        "pulled_tokens": payload.num_tokens,
        "payload_kv_bytes": payload.kv_bytes,
        "pickled_bytes": len(blob),
        "prefill_s": prefill_s,
        "export_s": t1 - t0,
        "pickle_s": t2 - t1,
        "unpickle_s": t3 - t2,
        "import_s": t4 - t3,
        "pull_s": pull_s,
        "transfer_tokens_per_s": payload.num_tokens / pull_s,
        "ttft_after_pull_s": hit_ttft_s,
        "ttft_local_hit_s": local_ttft_s,
        "cached_tokens_after_pull": cached_b,
        "cached_tokens_local_hit": cached_a,
        "outputs_equal": tokens_a == tokens_b,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prefix-tokens", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: one 64-token prefix, result file suffixed _quick",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix_tokens, args.repeats = 64, 1
    from worker.config import EngineConfig
    from worker.engine import LLMEngine

    load_start = os.getloadavg()
    rng = random.Random(0)
    blocks_per_rep = args.prefix_tokens // 16 + 4
    common = dict(
        model=args.model,
        device=args.device,
        max_num_batched_tokens=args.prefix_tokens + 64,
        max_model_len=max(2048, args.prefix_tokens + 128),
        num_kv_blocks=blocks_per_rep * (args.repeats + 1) * 2,
    )
    a, b = (
        LLMEngine(EngineConfig(**common), "replica-a"),
        LLMEngine(EngineConfig(**common), "replica-b"),
    )
    vocab = a.spec.vocab_size
    run_request(
        a, [rng.randrange(100, vocab) for _ in range(32)], "warm-a"
    )  # first-step costs out of the way
    run_request(b, [rng.randrange(100, vocab) for _ in range(32)], "warm-b")
    rows = []
    for rep in range(args.repeats):
        prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]
        question = [rng.randrange(100, vocab) for _ in range(16)]
        rows.append(one_pull(a, b, prefix, question, rep, args.device))
        r = rows[-1]
        print(
            f"rep {rep}: {r['pulled_tokens']} tokens, {r['pickled_bytes'] / 1e6:.1f} MB pickled; "
            f"prefill {r['prefill_s']:.3f} s, pull {r['pull_s']:.4f} s "
            f"(export {r['export_s']:.4f}, "
            f"pickle {r['pickle_s']:.4f}, unpickle {r['unpickle_s']:.4f}, "
            f"import {r['import_s']:.4f}); "
            f"TTFT after pull {r['ttft_after_pull_s']:.3f} s "
            f"vs local hit {r['ttft_local_hit_s']:.3f} s; "
            f"outputs equal: {r['outputs_equal']}"
        )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "outputs_equal"}
    prefill_tokens_per_s = args.prefix_tokens / med["prefill_s"]
    print(
        f"median: pull {med['transfer_tokens_per_s']:.0f} tokens/s "
        f"vs prefill {prefill_tokens_per_s:.0f} tokens/s "
        f"({med['prefill_s'] / med['pull_s']:.0f}x)"
    )
    result = {
        **result_header("kv_pull", "bench.kv_pull", argv, args.device),
        "note": "machine shared with other work while this ran; load averages below; "
        "numbers indicative only",
        "load_average_1_5_15_start": [round(x, 2) for x in load_start],
        "load_average_1_5_15_end": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model": args.model,
        "model_id": a.model_id,
        "dtype": str(a.runner.kv.dtype),
        "block_size": a.block_size,
        "prefix_tokens": args.prefix_tokens,
        "repeats": args.repeats,
        "kv_bytes_per_token": a.runner.bytes_per_block // a.block_size,
        "median": med,
        "prefill_tokens_per_s": prefill_tokens_per_s,
        "transfer_tokens_per_s": med["transfer_tokens_per_s"],
        "transfer_bytes_per_s": med["payload_kv_bytes"] / med["pull_s"],
        "not_included": "the network between Ray nodes: add pickled_bytes / link bandwidth",
        "outputs_equal": all(r["outputs_equal"] for r in rows),
        "runs": rows,
    }
    stem = result_stem("kv_pull", args.device, "_quick" if args.quick else "")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(f"wrote {stem.with_suffix('.json')}")
    return 0 if result["outputs_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
