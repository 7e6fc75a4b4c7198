"""LoRA throughput on the CPU: a batch spread over 0, 1, 4 or 16 distinct adapters.

Workload: a batch of ``--batch`` requests (random ``--prompt-tokens``-token prompts,
``--max-tokens`` greedy output tokens, EOS ignored), all added at once, the requests spread
round robin over N distinct adapters (N = 0: the base model alone, an engine without LoRA).
Adapters are random PEFT folders (``worker.testing.make_tiny_adapter``: all seven targets)
made once per (model, rank) and kept under ``~/.cache/prefixserve/bench_lora/``. Each rank
runs in its own engine (``max_loras=16``, ``max_lora_rank`` the largest rank) whose adapters
stay in their device slots once warmed up, so no cell times a slot load. Prefix caching is
off: every batch prefills in full.

Cells run interleaved, ``--rounds`` times, each time in a new order, so the base model and the
adapter cells see the same background load; each cell reports its median round. Per cell:
output tok/s of the whole batch (first add to last token), the median decode step (steps
where all requests decode), and both as a share of the base model's. The target: at most 30%
below the base model with 16 adapters at rank 16 (deterministic mode).

    python -m bench.lora                       # SmolLM2, ranks 8 and 16, both modes
    python -m bench.lora --modes deterministic --rounds 5 --tag det5
    python -m bench.lora --quick --out-dir /tmp/x   # tiny model and adapters: a smoke run

Writes ``<out-dir>/lora_cpu_<UTC date>[_<tag>].{json,md,png}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.result_files import RESULTS, result_header

MODES = ("deterministic", "fast")
TARGET_ADAPTERS, TARGET_RANK, TARGET_SHARE = 16, 16, 0.70
"""The target cell and the least share of the base model's tok/s it must keep."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    ap.add_argument("--model", default="smollm2", help="model name or HF folder (default smollm2)")
    ap.add_argument("--ranks", type=ints, default=[8, 16], help="adapter ranks (default 8,16)")
    ap.add_argument(
        "--adapters", type=ints, default=[0, 1, 4, 16], help="distinct adapters per batch"
    )
    ap.add_argument("--batch", type=int, default=32, help="requests per batch (default 32)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument(
        "--modes",
        type=lambda s: [m for m in s.split(",") if m],
        default=list(MODES),
        help="deterministic and/or fast (default both)",
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    ap.add_argument(
        "--quick", action="store_true", help="tiny random model and adapters, one small round"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.adapters, args.batch = [4, 8], [0, 1, 4], 8
        args.prompt_tokens, args.max_tokens, args.rounds = 16, 8, 1
        args.modes = ["deterministic"]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        ap.error(f"--modes: expected some of {','.join(MODES)}, got {bad or 'none'}")
    if 0 not in args.adapters:
        args.adapters = [0, *args.adapters]
    if max(args.adapters) > 16 or max(args.adapters) > args.batch or min(args.adapters) < 0:
        ap.error("--adapters: each count in [0, min(16, --batch)] (max_loras is 16)")
    return args


def cache_root() -> Path:
    return Path(os.environ.get("PREFIXSERVE_CACHE", Path.home() / ".cache" / "prefixserve"))


def make_adapters(model_path: str, rank: int, count: int, root: Path) -> list[str]:
    """``count`` random rank-``rank`` adapters for the model, made once under ``root``."""
    key = hashlib.sha1(str(Path(model_path).resolve()).encode()).hexdigest()[:10]
    from worker.testing import make_tiny_adapter

    paths = []
    for i in range(count):
        folder = root / f"{Path(model_path).name}_{key}" / f"r{rank}_{i}"
        if not (folder / "adapter_model.safetensors").is_file():
            print(f"  making adapter {folder}", flush=True)
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=folder.parent))
            make_tiny_adapter(model_path, tmp, rank=rank, seed=1000 * rank + i)
            tmp.rename(folder)
        paths.append(str(folder))
    return paths


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def run_batch(llm, prompts, names, max_tokens: int) -> dict:
    """One batch through the engine: tok/s first add to last token, median decode step."""
    from worker.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"b{t0}-{i}", prompt, params, lora_name=name)
    started: set[str] = set()
    tokens, decode_steps = 0, []
    while engine.has_unfinished():
        all_decoding = len(started) == len(prompts)
        s0 = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - s0
        if all_decoding and not any(o.finished for o in outs):
            decode_steps.append(took)
        for out in outs:
            if out.token_ids:
                started.add(out.request_id)
            if out.finished:
                tokens += len(out.token_ids)
    total = time.perf_counter() - t0
    return {
        "total_s": total,
        "output_tokens": tokens,
        "tok_s": tokens / total,
        "decode_step_ms": 1000 * statistics.median(decode_steps) if decode_steps else None,
    }


def _engine(model: str, deterministic: bool, batch: int, tokens: int, **lora):
    from worker import LLM

    blocks = batch * (-(-tokens // 16) + 1) + 16
    return LLM(
        model,
        deterministic=deterministic,
        max_num_seqs=batch,
        num_kv_blocks=blocks,
        enable_prefix_caching=False,
        **lora,
    )


def run_mode(args, mode: str, model: str, adapters: dict[int, list[str]], vocab: int) -> list:
    """Every (rank, N) cell of one mode, interleaved over ``args.rounds`` rounds."""
    deterministic = mode == "deterministic"
    tokens = args.prompt_tokens + args.max_tokens
    print(f"[{mode}] starting engines: base, " + ", ".join(f"rank {r}" for r in args.ranks))
    engines = {0: _engine(model, deterministic, args.batch, tokens)}
    for rank in args.ranks:
        names = {f"r{rank}_{i}": p for i, p in enumerate(adapters[rank])}
        engines[rank] = _engine(
            model,
            deterministic,
            args.batch,
            tokens,
            lora_modules=names,
            max_loras=16,
            max_lora_rank=max(args.ranks),
        )
    cells = [(0, 0)] + [(r, n) for r in args.ranks for n in args.adapters if n]

    def names_for(rank, n):
        return [f"r{rank}_{i % n}" if n else None for i in range(args.batch)]

    warm = make_prompts(args.batch, args.prompt_tokens, vocab, seed=-1)
    for rank, n in cells:  # fills the slots, packs every weight shape, warms the allocator
        run_batch(engines[rank], warm, names_for(rank, n), min(4, args.max_tokens))
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in cells}
    order = list(cells)
    for rnd in range(args.rounds):
        random.Random(rnd).shuffle(order)
        for k, (rank, n) in enumerate(order):
            prompts = make_prompts(args.batch, args.prompt_tokens, vocab, seed=1000 * rnd + k)
            r = run_batch(engines[rank], prompts, names_for(rank, n), args.max_tokens)
            runs[(rank, n)].append(r)
            label = "base" if not n else f"rank {rank}, {n:2d} adapters"
            print(
                f"[{mode}] round {rnd + 1}/{args.rounds} {label:22s} {r['tok_s']:7.1f} tok/s  "
                f"decode step {r['decode_step_ms'] or 0:6.1f} ms",
                flush=True,
            )
    for llm in engines.values():
        llm.shutdown()
    rows = []
    base = _median_row(runs[(0, 0)])
    for (rank, n), rs in runs.items():
        row = {"mode": mode, "rank": rank if n else None, "adapters": n, **_median_row(rs)}
        row["share_of_base"] = round(row["tok_s"] / base["tok_s"], 3)
        if row["decode_step_ms"] and base["decode_step_ms"]:
            row["decode_step_vs_base"] = round(row["decode_step_ms"] / base["decode_step_ms"], 3)
        row["rounds"] = [round(r["tok_s"], 2) for r in rs]
        rows.append(row)
    return rows


def _median_row(rs: list[dict]) -> dict:
    steps = [r["decode_step_ms"] for r in rs if r["decode_step_ms"] is not None]
    return {
        "tok_s": round(statistics.median(r["tok_s"] for r in rs), 2),
        "decode_step_ms": round(statistics.median(steps), 2) if steps else None,
        "output_tokens": rs[0]["output_tokens"],
    }


def verdict(rows: list[dict]) -> dict:
    """The target cell's share of base, in deterministic mode (else the first mode run)."""
    modes = [r["mode"] for r in rows]
    mode = "deterministic" if "deterministic" in modes else modes[0]
    cell = next(
        (
            r
            for r in rows
            if r["mode"] == mode and r["adapters"] == TARGET_ADAPTERS and r["rank"] == TARGET_RANK
        ),
        None,
    )
    line = (
        f"target: at most {100 * (1 - TARGET_SHARE):.0f}% below the base model with "
        f"{TARGET_ADAPTERS} adapters at rank {TARGET_RANK} ({mode} mode)"
    )
    if cell is None:
        return {"target": line, "mode": mode, "share_of_base": None, "verdict": "NOT RUN"}
    ok = cell["share_of_base"] >= TARGET_SHARE
    return {
        "target": line,
        "mode": mode,
        "share_of_base": cell["share_of_base"],
        "verdict": "PASS" if ok else "FAIL",
    }


def markdown(result: dict) -> str:
    rows, w = result["rows"], result["workload"]
    lines = [
        f"# LoRA throughput: {w['batch']} requests over N distinct adapters",
        "",
        f"{result['date']}, {result['machine']} ({result['cpu_description']}), torch threads "
        f"{result['torch_threads']}, commit {result['git_commit']}. Model `{w['model']}`; "
        f"{w['prompt_tokens']}-token prompts, {w['max_tokens']} greedy tokens (EOS ignored); "
        f"median of {w['rounds']} interleaved rounds. `{result['command']}`",
        "",
        "Each cell: output tok/s of the whole batch, median of the rounds (share of the base "
        "model's median), the best round's (share of the base's best round), then the median "
        "decode step in ms (ratio to the base's). The machine is shared: a round that another "
        "process's load fell on is slow in every cell it touched, the prefill's large GEMMs most; "
        "`rounds` in the JSON lists each round.",
        "",
    ]
    adapters = sorted({r["adapters"] for r in rows if r["adapters"]})
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mrows = [r for r in rows if r["mode"] == mode]
        base = next(r for r in mrows if r["adapters"] == 0)
        lines += [
            f"## {mode}",
            "",
            f"Base model alone: {base['tok_s']:.1f} tok/s, decode step "
            f"{base['decode_step_ms']} ms.",
            "",
            "| rank | " + " | ".join(f"{n} adapter{'s' * (n > 1)}" for n in adapters) + " |",
            "|---|" + "---|" * len(adapters),
        ]
        for rank in sorted({r["rank"] for r in mrows if r["rank"]}):
            cells = []
            for n in adapters:
                r = next((x for x in mrows if x["rank"] == rank and x["adapters"] == n), None)
                if r is None:
                    cells.append("-")
                    continue
                best = max(r["rounds"])
                cells.append(
                    f"{r['tok_s']:.1f} ({100 * r['share_of_base']:.0f}%), best {best:.1f} "
                    f"({100 * best / max(base['rounds']):.0f}%), "
                    f"{r['decode_step_ms']} ms ({r.get('decode_step_vs_base', 0):.2f}x)"
                )
            lines.append(f"| {rank} | " + " | ".join(cells) + " |")
        lines.append("")
    v = result["verdict"]
    share = "not run" if v["share_of_base"] is None else f"{100 * v['share_of_base']:.0f}% of base"
    lines += [f"**{v['verdict']}**: {v['target']}: {share}.", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    adapters = sorted({r["adapters"] for r in rows if r["adapters"]})
    ranks = sorted({r["rank"] for r in rows if r["rank"]})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 5.4), squeeze=False)
    colors = ["#7fb3d5", "#1f618d", "#a9cce3", "#154360"]
    width = 0.8 / len(ranks)
    for ax, mode in zip(axes[0], modes, strict=True):
        mrows = [r for r in rows if r["mode"] == mode]
        base = next(r for r in mrows if r["adapters"] == 0)["tok_s"]
        ax.axhline(base, color="#333333", label=f"base model alone ({base:.0f})")
        ax.axhline(
            TARGET_SHARE * base,
            color="#c0392b",
            linestyle="--",
            label=f"target: {100 * TARGET_SHARE:.0f}% of base",
        )
        for k, rank in enumerate(ranks):
            xs, ys, shares, cell_rows = [], [], [], []
            for j, n in enumerate(adapters):
                r = next((x for x in mrows if x["rank"] == rank and x["adapters"] == n), None)
                if r:
                    xs.append(j + (k - (len(ranks) - 1) / 2) * width)
                    ys.append(r["tok_s"])
                    shares.append(r["share_of_base"])
                    cell_rows.append(r)
            spread = [
                [y - min(r["rounds"]) for y, r in zip(ys, cell_rows, strict=True)],
                [max(r["rounds"]) - y for y, r in zip(ys, cell_rows, strict=True)],
            ]
            bars = ax.bar(
                xs,
                ys,
                width,
                yerr=spread,
                capsize=3,
                ecolor="#888888",
                color=colors[k % len(colors)],
                label=f"rank {rank}",
            )
            for bar, share in zip(bars, shares, strict=True):
                ax.annotate(
                    f"{100 * share:.0f}%",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(range(len(adapters)), [str(n) for n in adapters])
        ax.set_xlabel(f"distinct adapters in a batch of {result['workload']['batch']}")
        ax.set_ylabel("output tokens/s, median of rounds (whiskers: slowest, fastest)")
        top = max([base, *(max(r["rounds"]) for r in mrows)])
        ax.set_ylim(0, 1.15 * top)
        ax.set_title(f"{mode} mode")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)
    fig.suptitle(
        f"LoRA throughput, {result['workload']['model_name']}, {result['machine']}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(args, header: dict, model: str, rows: list[dict]) -> Path:
    """The run's JSON, table and plot; their common path stem."""
    import torch

    from kernels.linear import cpu_description

    result = {
        **header,
        "cpu_description": cpu_description(),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "model": model if not args.quick else "tiny random llama (worker.testing)",
            "model_name": "tiny" if args.quick else Path(args.model).name,
            "batch": args.batch,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "ranks": args.ranks,
            "adapters": args.adapters,
            "rounds": args.rounds,
            "max_loras": 16,
            "targets": "q,k,v,o,gate,up,down",
        },
        "rows": rows,
    }
    result["verdict"] = verdict(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    stem = args.out_dir / f"lora_cpu_{stamp}{'_' + args.tag if args.tag else ''}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    Path(f"{stem}.md").write_text(markdown(result))
    plot(result, Path(f"{stem}.png"))
    return stem


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from worker.loader import resolve_model

    header = result_header("lora", "bench.lora", argv)
    tmp = None
    if args.quick:
        from worker.testing import make_tiny_model

        tmp = tempfile.TemporaryDirectory()
        model = make_tiny_model(Path(tmp.name) / "model")
        root = Path(tmp.name) / "adapters"
    else:
        model = args.model
        root = cache_root() / "bench_lora"
    model_path = model if Path(model).is_dir() else resolve_model(model).path
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    print(f"adapters: ranks {args.ranks}, {max(args.adapters)} each, under {root}", flush=True)
    adapters = {r: make_adapters(model_path, r, max(args.adapters), root) for r in args.ranks}
    rows = []
    for mode in args.modes:  # the files are rewritten after each mode: a cut run keeps its cells
        rows += run_mode(args, mode, model, adapters, vocab)
        stem = write_results(args, header, model, rows)
    print(markdown(json.loads(Path(f"{stem}.json").read_text())))
    print(f"wrote {stem}.json, .md and .png", flush=True)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
