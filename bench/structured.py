"""What structured outputs cost: decode tok/s with and without a JSON schema, batch 8 and 64.

One ``LLM`` (the bundled SmolLM2 unless ``--model``). For each batch size, the same prompts
run twice through ``LLM.generate``: unconstrained (EOS ignored) and under a JSON schema whose
shortest valid output is longer than ``--max-tokens`` (an array of exactly 64 integers), so
both runs produce exactly ``max_tokens`` tokens per request and do the same model work. The
difference is the grammar: the per-row token mask in the sampler and advancing the matcher.
Those two are also timed on their own (``GrammarMatcher.mask_logits`` and ``advance``,
wrapped for this run only) and reported per constrained row per step. A warm-up request
compiles the schema and builds llguidance's tokenizer before any timing.

    python -m bench.structured               # batch 8 and 64, 64 tokens each, 3 repeats
    python -m bench.structured --quick       # batch 2 and 4, 8 tokens, 1 repeat: a smoke run

Writes ``bench/results/structured_<cpu|cuda>_<date>[_quick].json`` and a PNG.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from contextlib import contextmanager

from bench.result_files import result_header, result_stem

SCHEMA = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9999},
            "minItems": 64,
            "maxItems": 64,
        }
    },
    "required": ["values"],
    "additionalProperties": False,
}


def make_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        tokenizer.encode(
            f"List {rng.randint(10, 99)} measurements of sensor {rng.randint(1000, 9999)} as JSON:"
        )
        for _ in range(n)
    ]


@contextmanager
def grammar_timers():
    """Wraps the matcher's per-step calls with timers; yields {name: [seconds, calls]}."""
    from worker.structured_output import GrammarMatcher

    totals = {"mask_logits": [0.0, 0], "advance": [0.0, 0]}
    originals = {name: getattr(GrammarMatcher, name) for name in totals}

    def timed(name):
        fn = originals[name]

        def wrapper(self, *args):
            t0 = time.perf_counter()
            try:
                return fn(self, *args)
            finally:
                totals[name][0] += time.perf_counter() - t0
                totals[name][1] += 1

        return wrapper

    for name in totals:
        setattr(GrammarMatcher, name, timed(name))
    try:
        yield totals
    finally:
        for name, fn in originals.items():
            setattr(GrammarMatcher, name, fn)


def run_once(llm, prompts, max_tokens: int, constrained: bool) -> dict:
    from worker.sampling_params import SamplingParams
    from worker.structured_output import StructuredOutputSpec

    spec = StructuredOutputSpec(json_schema=SCHEMA) if constrained else None
    params = [
        SamplingParams(
            temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True, structured_output=spec
        )
        for i in range(len(prompts))
    ]
    with grammar_timers() as totals:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if constrained:
        for o in outs:
            text = o.outputs[0].text
            assert o.outputs[0].finish_reason == "length" and text.startswith('{"values":['), text[
                :80
            ]
    mask_s, mask_calls = totals["mask_logits"]
    adv_s, adv_calls = totals["advance"]
    return {
        "output_tokens": tokens,
        "elapsed_s": elapsed_s,
        "tokens_per_s": tokens / elapsed_s,
        "mask_us_per_row": 1e6 * mask_s / mask_calls if mask_calls else 0.0,
        "advance_us_per_row": 1e6 * adv_s / adv_calls if adv_calls else 0.0,
        "grammar_share": (mask_s + adv_s) / elapsed_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None, help="the engine's device (default: EngineConfig's)")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: the engine's default)"
    )
    ap.add_argument("--quick", action="store_true", help="batch 2 and 4, 8 tokens, 1 repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.max_tokens, args.repeats = [2, 4], 8, 1
    if args.max_tokens > 64 * 2:
        ap.error("--max-tokens must stay below the schema's shortest output (about 130 tokens)")

    from worker.llm import LLM

    options = {"max_num_seqs": max(args.batch_sizes), "num_kv_blocks": 4096}
    if args.device:
        options["device"] = args.device
    if args.threads:
        options["num_threads"] = args.threads
    llm = LLM(args.model, **options)
    device = llm.engine.config.device
    run_once(
        llm, make_prompts(llm.tokenizer, 1, seed=99), 4, constrained=True
    )  # compile, build tokenizer

    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(llm.tokenizer, batch, seed=batch)
        for constrained in (False, True):
            runs = [
                run_once(llm, prompts, args.max_tokens, constrained) for _ in range(args.repeats)
            ]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            rows.append(
                {
                    "batch": batch,
                    "constrained": constrained,
                    **best,
                    "tokens_per_s_all": [r["tokens_per_s"] for r in runs],
                }
            )
            print(
                f"batch {batch:3d} {'schema' if constrained else 'plain ':6s} "
                f"{best['tokens_per_s']:8.1f} tok/s"
                f"  mask {best['mask_us_per_row']:6.0f} us/row  "
                f"advance {best['advance_us_per_row']:4.0f} us/row"
                f"  grammar {100 * best['grammar_share']:4.1f}% of the time",
                flush=True,
            )

    result = {
        **result_header("structured", "bench.structured", argv, device),
        "model": args.model,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "schema": SCHEMA,
        "rows": rows,
        "slowdown": {
            str(b): 1
            - next(r for r in rows if r["batch"] == b and r["constrained"])["tokens_per_s"]
            / next(r for r in rows if r["batch"] == b and not r["constrained"])["tokens_per_s"]
            for b in args.batch_sizes
        },
    }
    stem = result_stem("structured", device, "_quick" if args.quick else "")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")
    return 0


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in result["rows"]})
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.38
    for k, constrained in enumerate((False, True)):
        vals = [
            next(
                r["tokens_per_s"]
                for r in result["rows"]
                if r["batch"] == b and r["constrained"] == constrained
            )
            for b in batches
        ]
        xs = [i + (k - 0.5) * width for i in range(len(batches))]
        ax.bar(xs, vals, width, label="JSON schema" if constrained else "unconstrained")
        for x, v in zip(xs, vals, strict=True):
            ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"Structured outputs: {result['model']}, {result['max_tokens']} tokens/request "
        f"({result['device']})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
