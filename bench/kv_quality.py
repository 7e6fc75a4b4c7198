"""What an 8-bit KV cache costs in quality: int8 and fp8_e4m3 K/V against the float32 cache.

One run on the bundled SmolLM2 (``--model``), one ``LLM`` per KV dtype (``auto``, the
model's float32, first; then each of ``--dtypes``), all else equal:

1. Greedy agreement: ``--num-prompts`` prompts built here (no downloads): short chat
   questions, plain-text openings, and long chat and plain-text prompts of 300-650 tokens
   (several 128-key attention chunks, and prefills split over steps), ``--max-tokens``
   greedy tokens each (EOS ignored), all in one ``generate`` call per dtype. Per 8-bit
   dtype against float32: the share of prompts whose tokens are all identical, the mean
   share of tokens before the first divergence, and the position-wise token agreement.
2. Teacher-forced log-probabilities: one fixed English text of about 600 tokens (``TEXT``)
   scored with ``prompt_logprobs=0``: the mean and max |logprob(8-bit) - logprob(float32)|
   over its tokens, each dtype's mean logprob and perplexity (exp(-mean)), and the share of
   tokens whose top-1 status (rank 1 or not) differs from float32's.
3. KV capacity: the blocks an engine gets for ``--kv-cache-bytes`` (64 MiB) per dtype
   (``LLMEngine.pool.num_blocks``), the bytes per block, and the ratio to float32.
4. Candidate formats (``--variants``, ``bench/kv_quant_variants.py``): other 8-bit row
   numerics (a scale per channel group, asymmetric rows, K in float16), simulated on the
   float32 cache, with the blocks their rows' bytes would give; ``int8-sim`` is the control
   (today's int8 through the same simulation).
5. The rounding floor (row ``auto-fast``): the float32 cache again, computed by the fast,
   not batch-invariant kernels (``deterministic=False``), against the same baseline. Any
   change in the last bits moves a small model's near-tied greedy choices; this row says how
   much greedy agreement a mere change of rounding costs, the yardstick for the 8-bit rows.

    python -m bench.kv_quality                                   # the full run, a few minutes
    python -m bench.kv_quality --num-prompts 8 --max-tokens 16   # a smoke run
    python -m bench.kv_quality --variants int8-sim,int8-g16,int8-asym,k16-v8

Writes ``bench/results/kv_quality_<cpu|cuda>_<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import time
from pathlib import Path

from bench.kv_quant_variants import CALIBRATION_TEXT, VARIANTS, simulate
from bench.result_files import result_header, result_stem

BASELINE = "auto"

QUESTIONS = [
    "What is the difference between weather and climate?",
    "Give me three tips for learning to play the guitar.",
    "Why is the sky blue during the day and red at sunset?",
    "Explain what a hash table is to a new programmer.",
    "How do vaccines train the immune system?",
    "Write a short poem about a lighthouse in winter.",
    "What should I pack for a three-day hiking trip?",
    "How does compound interest work? Use an example.",
    "What were the main causes of the French Revolution?",
    "Suggest a simple recipe for a vegetarian dinner.",
    "How do bees communicate where flowers are?",
    "What is the Pythagorean theorem and why is it useful?",
]

OPENINGS = [
    "Once upon a time, in a small village at the edge of a great forest,",
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Dear hiring manager,\n\nI am writing to apply for",
    "The three laws of thermodynamics can be summarized as follows:",
    "Chapter 1\n\nThe train was late again, and Maria",
    "In 1969, the Apollo 11 mission",
    "Photosynthesis is the process by which",
]

PARAGRAPHS = [
    "The old harbor town woke slowly each morning. Fishermen checked their nets by lantern "
    "light, bakers pulled the first loaves from brick ovens, and gulls circled above the "
    "market square waiting for scraps. By nine o'clock the streets were full of carts, "
    "tourists with maps, and children running late for school.",
    "A good cup of coffee depends on four things: fresh beans, the right grind, clean water "
    "at about ninety degrees, and patience. Beans lose their aroma within weeks of roasting, "
    "so buy small bags often. Grind just before brewing, coarse for a French press and fine "
    "for espresso, and let the grounds bloom for thirty seconds before pouring the rest.",
    "Glaciers move more than most people imagine. Pressed by their own weight, layers of "
    "ice deform and slide over the rock below, carving valleys shaped like the letter U. "
    "When a glacier retreats it leaves behind moraines, piles of gravel and boulders that "
    "mark how far the ice once reached, sometimes hundreds of kilometres from the mountains.",
    "The committee met on Tuesday to review the budget for the new library. Members agreed "
    "that the reading room needed better lighting and that the children's section should "
    "double in size. They disagreed about the cafe: some felt it would bring visitors, while "
    "others worried about noise and crumbs near the rare book collection.",
    "To replace a bicycle tire, first open the brake and remove the wheel. Let out any air "
    "left in the tube, then use two tire levers to lift one side of the tire over the rim. "
    "Pull out the old tube, check the inside of the tire for glass or thorns, fit the new "
    "tube slightly inflated, and work the tire back onto the rim with your thumbs.",
    "Octopuses are among the most intelligent invertebrates. They can open jars, squeeze "
    "through gaps no wider than their beak, and change the color and texture of their skin "
    "in a fraction of a second. Each arm holds a large share of the animal's neurons, so an "
    "arm can explore and grasp objects with surprising independence from the brain.",
    "The quarterly report showed revenue up eight percent over the previous year, driven "
    "mostly by the online store. Costs rose faster than expected because of shipping and "
    "new warehouse staff. The board asked management to present a plan for improving "
    "margins before the next meeting, including options for regional distribution centres.",
    "In the early days of computing, programs were written on punched cards and submitted "
    "in batches. A single typo could mean waiting until the next day to try again. "
    "Interactive terminals changed everything: programmers could edit, compile and run code "
    "within minutes, and the culture of quick experiments that we take for granted was born.",
    "Her grandmother's garden had no straight lines. Tomatoes climbed over the fence, mint "
    "spread wherever it pleased, and a fig tree leaned against the shed as if it were tired. "
    "Every summer evening the two of them walked the paths with a basket, picking whatever "
    "was ripe and arguing cheerfully about what to cook with it.",
    "Sleep is not a passive state. During the night the brain cycles through stages of light "
    "sleep, deep sleep and rapid eye movement sleep roughly every ninety minutes. Deep sleep "
    "helps the body repair tissue and consolidate memories of facts, while dreaming sleep "
    "seems to matter for emotional balance and for learning new skills.",
]

TEXT = """\
The story of the bicycle is a story of small improvements that added up to a revolution. \
The first machines of the early nineteenth century had no pedals at all. Riders sat on a \
wooden frame between two wheels and pushed themselves along the road with their feet, much \
as a child does on a balance bike today. These running machines were fashionable for a few \
summers and then mostly forgotten, partly because they were heavy and partly because riders \
kept crashing into pedestrians on the pavement.

Pedals arrived decades later, fixed directly to the front wheel. Because each turn of the \
pedals turned the wheel exactly once, the only way to go faster was to make the front wheel \
larger. The result was the high wheeler, a tall and elegant machine whose front wheel could \
be as wide as a grown man was tall. It was quick on a smooth road, but a stone or a pothole \
could throw the rider over the handlebars, and a fall from that height was dangerous. Riding \
one was a sport for young men with courage and money, not a way for ordinary people to get \
to work.

The breakthrough came with the chain drive. By connecting the pedals to the rear wheel \
through a chain and two toothed sprockets, designers could gear the machine up without \
making any wheel enormous. The so-called safety bicycle had two wheels of equal size, a \
diamond-shaped frame and the rider sitting low between them. Pneumatic tires, filled with \
air instead of made of solid rubber, followed within a few years and made the ride far more \
comfortable. By the end of the century the basic design was settled, and a modern rider \
would recognise it at once.

The social effects were enormous. For the first time, working people could travel several \
miles to a factory, a market or a neighbouring village without owning a horse. Doctors \
could visit patients more quickly, and clubs organised weekend trips into the countryside. \
Women in particular found a new kind of freedom: the bicycle demanded practical clothing, \
and many campaigners for women's rights saw it as a symbol of independence. Roads improved \
too, because cyclists formed associations that lobbied for smooth surfaces years before \
cars became common.

In the twentieth century the car pushed the bicycle to the side of the road in many \
countries, yet it never disappeared. In some cities it remained the main way to get around, \
and engineers kept refining it with lighter metals, gears hidden inside the hub, and \
reliable brakes. Today the bicycle is enjoying another revival. Cities build protected \
lanes, electric motors help riders climb hills and carry children or groceries, and shared \
bikes wait on street corners for anyone with a phone. A machine that began as a wooden toy \
for the fashionable has become one of the most efficient ways ever invented to move a \
person from one place to another. Few inventions have changed so little in a hundred years \
and still feel so modern every time someone climbs on and starts to pedal.
"""


def make_prompts(tokenizer, n: int, seed: int = 0) -> list[dict]:
    """``n`` prompts, four kinds in turn: a short chat question, a plain-text opening, a long
    chat request over 3-7 paragraphs, a long plain text of 4-7 paragraphs; each a dict with
    ``kind`` and ``ids``."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        kind = ("chat_short", "plain_short", "chat_long", "plain_long")[i % 4]
        if kind == "chat_short":
            q = QUESTIONS[(i // 4) % len(QUESTIONS)]
            ids = tokenizer.apply_chat_template([{"role": "user", "content": q}])
        elif kind == "plain_short":
            ids = tokenizer.encode(OPENINGS[(i // 4) % len(OPENINGS)])
        elif kind == "chat_long":
            paras = rng.sample(PARAGRAPHS, rng.randint(3, 7))
            task = rng.choice(
                [
                    "Summarize the following notes in a few sentences.",
                    "Read the notes below and list the main topics they cover.",
                    "Which of the following passages is the most interesting, and why?",
                ]
            )
            content = task + "\n\n" + "\n\n".join(paras)
            ids = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        else:
            paras = rng.sample(PARAGRAPHS, rng.randint(4, 7))
            ids = tokenizer.encode("\n\n".join(paras) + "\n\n")
        prompts.append({"kind": kind, "ids": ids})
    return prompts


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy outputs of one dtype against the baseline's, prompt by prompt."""
    identical, before, matches, total = 0, [], 0, 0
    length = max(len(b) for b in base)
    by_position = [0] * length
    for b, o in zip(base, other, strict=True):
        same = [x == y for x, y in zip(b, o, strict=False)]
        first = next((j for j, s in enumerate(same) if not s), len(same))
        identical += first == len(b) == len(o)
        before.append(first / len(b))
        matches += sum(same)
        total += len(b)
        for j, s in enumerate(same):
            by_position[j] += s
    return {
        "identical": identical / len(base),
        "num_identical": identical,
        "before_first_divergence": sum(before) / len(before),
        "position_agreement": matches / total,
        "agreement_by_position": [c / len(base) for c in by_position],
        "first_divergence_share_per_prompt": before,
    }


def logprob_compare(base: list, other: list) -> dict:
    """Teacher-forced prompt logprobs of one dtype against the baseline's (first token: None)."""
    pairs = list(zip(base[1:], other[1:], strict=True))
    diffs = [abs(o.logprob - b.logprob) for b, o in pairs]
    top1_flips = sum((b.rank == 1) != (o.rank == 1) for b, o in pairs)
    return {
        "mean_abs_dlogprob": sum(diffs) / len(diffs),
        "max_abs_dlogprob": max(diffs),
        "top1_flip_share": top1_flips / len(diffs),
    }


FLOOR = "auto-fast"
"""The rounding-floor run: the float32 cache through the fast kernels."""


def run_dtype(
    args,
    dtype: str,
    prompts: list[dict],
    text_ids: list[int],
    num_blocks: int,
    calibration_ids: list[int] | None = None,
) -> dict:
    from worker.llm import LLM
    from worker.sampling_params import SamplingParams

    t0 = time.perf_counter()
    options = {"kv_cache_dtype": dtype, "num_kv_blocks": num_blocks, "max_num_seqs": 64}
    if dtype == FLOOR:
        options.update(kv_cache_dtype=BASELINE, deterministic=False)
    simulated = VARIANTS.get(dtype)
    if simulated is not None:
        options["kv_cache_dtype"] = BASELINE
    if args.threads:
        options["num_threads"] = args.threads
    llm = LLM(args.model, **options)
    if simulated is not None:
        simulate(llm, simulated, calibration_ids)
    t_load = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t1 = time.perf_counter()
    outs = llm.generate([p["ids"] for p in prompts], params, use_tqdm=False)
    t_gen = time.perf_counter() - t1
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == args.max_tokens for t in tokens), [len(t) for t in tokens]
    print(
        f"  {dtype}: {len(prompts)} prompts x {args.max_tokens} greedy tokens in {t_gen:.1f} s "
        f"(engine start {t_load:.1f} s)",
        flush=True,
    )
    t2 = time.perf_counter()
    scored = llm.generate(
        [text_ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    t_score = time.perf_counter() - t2
    lps = scored.prompt_logprobs
    assert lps is not None and len(lps) == len(text_ids) and lps[0] is None
    mean_lp = sum(lp.logprob for lp in lps[1:]) / (len(lps) - 1)
    print(
        f"  {dtype}: scored {len(text_ids)} text tokens in {t_score:.1f} s: mean logprob "
        f"{mean_lp:.4f}, perplexity {math.exp(-mean_lp):.3f}",
        flush=True,
    )
    result = {
        "dtype": dtype,
        "tokens": tokens,
        "texts": [o.outputs[0].text for o in outs],
        "prompt_logprobs": lps,
        "mean_logprob": mean_lp,
        "perplexity": math.exp(-mean_lp),
        "load_s": t_load,
        "generate_s": t_gen,
        "score_s": t_score,
        "device": llm.engine.config.device,
    }
    llm.shutdown()
    return result


def simulated_capacity(base: dict, name: str, head_dim: int) -> dict:
    """What a simulated variant's engine would get for the same bytes: the float32 block's
    bytes scaled by the variant's row bytes (computed, not allocated)."""
    ratio = VARIANTS[name].blocks_ratio_to_float32(head_dim)
    num_blocks = int(base["num_blocks"] * ratio)
    return {
        "dtype": name,
        "cache_dtype": "uint8 (computed)",
        "bytes_per_block": round(base["bytes_per_block"] / ratio),
        "num_blocks": num_blocks,
        "tokens": num_blocks * base["tokens"] // base["num_blocks"],
    }


def capacity(args, dtype: str) -> dict:
    """Blocks an engine of ``dtype`` gets for ``--kv-cache-bytes``."""
    from worker.config import EngineConfig
    from worker.engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model=args.model, kv_cache_dtype=dtype, kv_cache_bytes=args.kv_cache_bytes)
    )
    row = {
        "dtype": dtype,
        "cache_dtype": engine.runner.kv_cache_dtype,
        "bytes_per_block": engine.runner.bytes_per_block,
        "num_blocks": engine.pool.num_blocks,
        "tokens": engine.pool.num_blocks * engine.block_size,
        "head_dim": engine.runner.model.spec.head_dim,
    }
    engine.shutdown()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="int8,fp8_e4m3", help="8-bit KV dtypes, comma-separated")
    ap.add_argument(
        "--variants",
        default="",
        help="candidate formats simulated on the float32 cache (bench/kv_quant_variants.py), "
        f"comma-separated: {','.join(VARIANTS)}",
    )
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="for the capacity rows")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's)")
    ap.add_argument("--out-dir", default=None, help="where results go (default bench/results)")
    ap.add_argument("--suffix", default="", help="appended to the result files' stem")
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    from kernels.kv_quant import KV_CACHE_DTYPES

    bad = [d for d in dtypes if d not in KV_CACHE_DTYPES or d == BASELINE]
    if bad:
        ap.error(f"--dtypes takes 8-bit dtypes of {KV_CACHE_DTYPES[1:]}, got {bad}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants takes {sorted(VARIANTS)}, got {unknown}")
    if args.num_prompts < 1 or args.max_tokens < 1:
        ap.error("--num-prompts and --max-tokens must be positive")

    from worker.config import EngineConfig
    from worker.loader import load_tokenizer, resolve_engine_model

    start = time.perf_counter()
    config = EngineConfig(model=args.model)
    tokenizer = load_tokenizer(config, model_path=resolve_engine_model(config).path)
    prompts = make_prompts(tokenizer, args.num_prompts)
    text_ids = tokenizer.encode(TEXT)
    calibration_ids = tokenizer.encode(CALIBRATION_TEXT)
    lengths = [len(p["ids"]) for p in prompts]
    block = config.block_size
    num_blocks = sum(-(-(n + args.max_tokens) // block) for n in lengths) + 64
    print(
        f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens "
        f"({sum(n > 300 for n in lengths)} over 300), {args.max_tokens} greedy tokens each; "
        f"text of {len(text_ids)} tokens; {num_blocks} KV blocks per engine",
        flush=True,
    )

    runs = {}
    for dtype in [BASELINE, FLOOR, *dtypes, *variants]:
        print(f"kv_cache_dtype={dtype}", flush=True)
        runs[dtype] = run_dtype(args, dtype, prompts, text_ids, num_blocks, calibration_ids)
        gc.collect()

    caps = {}
    for dtype in [BASELINE, *dtypes]:
        caps[dtype] = capacity(args, dtype)
        gc.collect()
    caps[FLOOR] = caps[BASELINE]
    for name in variants:
        caps[name] = simulated_capacity(caps[BASELINE], name, caps[BASELINE]["head_dim"])
    for dtype, row in caps.items():
        row["ratio_to_float32"] = row["num_blocks"] / caps[BASELINE]["num_blocks"]
        print(
            f"capacity {dtype}: {row['num_blocks']} blocks ({row['tokens']} tokens) in "
            f"{args.kv_cache_bytes / 2**20:g} MiB, {row['ratio_to_float32']:.2f}x float32",
            flush=True,
        )

    base = runs[BASELINE]
    rows = []
    for dtype in [BASELINE, FLOOR, *dtypes, *variants]:
        run = runs[dtype]
        agree = agreement(base["tokens"], run["tokens"])
        lp = logprob_compare(base["prompt_logprobs"], run["prompt_logprobs"])
        by_kind = {}
        for kind in sorted({p["kind"] for p in prompts}):
            idx = [i for i, p in enumerate(prompts) if p["kind"] == kind]
            sub = agreement([base["tokens"][i] for i in idx], [run["tokens"][i] for i in idx])
            by_kind[kind] = {
                k: sub[k] for k in ("identical", "before_first_divergence", "position_agreement")
            }
        rows.append(
            {
                "dtype": dtype,
                **{k: v for k, v in agree.items()},
                "by_kind": by_kind,
                **lp,
                "mean_logprob": run["mean_logprob"],
                "perplexity": run["perplexity"],
                **{
                    k: caps[dtype][k]
                    for k in ("cache_dtype", "num_blocks", "bytes_per_block", "tokens")
                },
                "blocks_ratio_to_float32": caps[dtype]["ratio_to_float32"],
                "generate_s": run["generate_s"],
                "score_s": run["score_s"],
            }
        )
        if dtype != BASELINE:
            print(
                f"{dtype}: identical {100 * agree['identical']:.1f}% "
                f"({agree['num_identical']}/{len(prompts)}), before first divergence "
                f"{100 * agree['before_first_divergence']:.1f}%, position-wise "
                f"{100 * agree['position_agreement']:.1f}%; mean |dlogprob| "
                f"{lp['mean_abs_dlogprob']:.5f} (max {lp['max_abs_dlogprob']:.4f}), perplexity "
                f"{run['perplexity']:.3f} vs {base['perplexity']:.3f}",
                flush=True,
            )

    elapsed = time.perf_counter() - start
    device = base["device"]
    import torch

    torch_threads = torch.get_num_threads()
    result = {
        **result_header("kv_quality", "bench.kv_quality", argv, device),
        "engine_device": device,
        "torch_threads": torch_threads,
        "model": args.model,
        "baseline": f"{BASELINE} ({caps[BASELINE]['cache_dtype']})",
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "prompt_tokens": lengths,
        "prompt_kinds": [p["kind"] for p in prompts],
        "prompts_over_300_tokens": sum(n > 300 for n in lengths),
        "text_tokens": len(text_ids),
        "kv_cache_bytes": args.kv_cache_bytes,
        "elapsed_s": elapsed,
        "rows": rows,
        "outputs": {d: runs[d]["texts"] for d in runs},
    }
    stem = result_stem("kv_quality", device, args.suffix)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / stem.name
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md and .png; {elapsed:.0f} s in all", flush=True)
    return 0


def machine(result: dict) -> str:
    """The GPU's name, or the CPU's with the torch threads the engines ran."""
    if result["engine_device"].startswith("cuda"):
        return result["device"]
    return f"{result['machine']}, {result['torch_threads']} torch threads"


def markdown(result: dict) -> str:
    lines = [
        f"# KV cache quality: {result['model']}, 8-bit K/V against float32",
        "",
        f"`{result['command']}` on {machine(result)}, {result['date']}; "
        f"{result['num_prompts']} prompts ({result['prompts_over_300_tokens']} over 300 "
        f"tokens), {result['max_tokens']} greedy tokens each; a {result['text_tokens']}-token "
        f"text teacher-forced; capacity in {result['kv_cache_bytes'] / 2**20:g} MiB.",
        "",
        "| KV dtype | identical outputs | tokens before first divergence | position-wise "
        "agreement | mean \\|Δlogprob\\| | max \\|Δlogprob\\| | top-1 flips | mean logprob | "
        "perplexity | blocks | x float32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['dtype']} | {100 * r['identical']:.1f}% | "
            f"{100 * r['before_first_divergence']:.1f}% | {100 * r['position_agreement']:.1f}% | "
            f"{r['mean_abs_dlogprob']:.5f} | {r['max_abs_dlogprob']:.4f} | "
            f"{100 * r['top1_flip_share']:.2f}% | {r['mean_logprob']:.4f} | "
            f"{r['perplexity']:.3f} | {r['num_blocks']} | {r['blocks_ratio_to_float32']:.2f} |"
        )
    simulated = [r["dtype"] for r in result["rows"] if r["dtype"] in VARIANTS]
    if simulated:
        lines += [
            "",
            f"Rows {', '.join(simulated)} are candidate formats simulated on the float32 cache "
            "(`bench/kv_quant_variants.py`: each new K/V row quantized and read back before it "
            "is stored); their blocks are computed from the row's bytes.",
        ]
    lines += ["", "By kind of prompt (identical / before first divergence / position-wise):", ""]
    kinds = list(result["rows"][0]["by_kind"])
    lines.append("| KV dtype | " + " | ".join(kinds) + " |")
    lines.append("|---" * (len(kinds) + 1) + "|")
    for r in result["rows"][1:]:
        cells = [
            f"{100 * k['identical']:.0f}% / {100 * k['before_first_divergence']:.0f}% / "
            f"{100 * k['position_agreement']:.0f}%"
            for k in r["by_kind"].values()
        ]
        lines.append(f"| {r['dtype']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"][1:]
    dtypes = [r["dtype"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), gridspec_kw={"width_ratios": [3, 2, 2]})

    ax = axes[0]
    metrics = [
        ("identical", "identical outputs"),
        ("before_first_divergence", "before 1st divergence"),
        ("position_agreement", "position-wise"),
    ]
    width = 0.8 / len(metrics)
    for k, (key, label) in enumerate(metrics):
        xs = [i + (k - (len(metrics) - 1) / 2) * width for i in range(len(rows))]
        vals = [100 * r[key] for r in rows]
        ax.bar(xs, vals, width, label=label)
        for x, v in zip(xs, vals, strict=True):
            ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), dtypes)
    ax.set_ylim(0, 135)
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("% (vs float32 KV)")
    ax.set_title(
        f"greedy agreement: {result['num_prompts']} prompts x {result['max_tokens']} tokens",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper center", ncol=3, handlelength=1, columnspacing=0.8)

    ax = axes[1]
    vals = [r["mean_abs_dlogprob"] for r in rows]
    bars = ax.bar(range(len(rows)), vals, 0.6, color="tab:purple")
    for bar, r in zip(bars, rows, strict=True):
        ax.annotate(
            f"{r['mean_abs_dlogprob']:.4f}\nmax {r['max_abs_dlogprob']:.3f}\n"
            f"ppl {r['perplexity']:.3f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(range(len(rows)), dtypes)
    ax.set_ylim(0, max(vals) * 1.6 if max(vals) > 0 else 1)
    ax.set_ylabel("mean |Δ logprob| per token")
    ax.set_title(
        f"teacher-forced, {result['text_tokens']} tokens (float32 ppl "
        f"{result['rows'][0]['perplexity']:.3f})",
        fontsize=9,
    )

    ax = axes[2]
    all_rows = result["rows"]
    vals = [r["num_blocks"] for r in all_rows]
    bars = ax.bar(range(len(all_rows)), vals, 0.6, color="tab:green")
    for bar, r in zip(bars, all_rows, strict=True):
        ax.annotate(
            f"{r['num_blocks']} ({r['blocks_ratio_to_float32']:.2f}x)",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(range(len(all_rows)), [r["cache_dtype"] for r in all_rows])
    ax.set_ylim(0, max(vals) * 1.15)
    ax.set_ylabel("KV blocks")
    ax.set_title(f"capacity in {result['kv_cache_bytes'] / 2**20:g} MiB", fontsize=9)

    fig.suptitle(
        f"8-bit KV cache vs float32: {result['model']} ({machine(result)})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
