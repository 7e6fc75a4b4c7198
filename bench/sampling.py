"""What the sampler costs per decode step, by batch size and sampling settings.

    python -m bench.sampling [--batch 1 16 64 256] [--vocab 49152] [--device cpu]
                             [--steps 5] [--threads 1] [--tag _X]

Times ``Sampler.sample`` over one step's logits (``batch`` rows of ``--vocab``, SmolLM2's
by default), every row with the same settings, for each of ``KINDS``: greedy, temperature
alone (OpenAI's defaults are temperature 1, top-p 1), temperature with top-p, with top-k,
with min-p, and with a presence penalty (a row the sampler transforms on the host, one at a
time). The logits are Zipf-like, as a language model's next-token distributions are: the
r-th likeliest token of a row ``-1.2 ln r`` plus a little noise, the ranks a random
permutation per row; a seed per row. On CUDA each step ends with the token ids on the host,
as the engine's does. Medians of ``--steps`` steps after one untimed; ``--threads``: torch's
CPU threads (1: what an engine replica's sampling on a busy host gets).

Writes ``bench/results/sampling_<cpu|cuda>_<UTC date><--tag>.json`` and a ``.png`` of ms per
step against batch size, one line per kind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.result_files import result_header, result_stem
from worker.request import Request
from worker.sampler import Sampler
from worker.sampling_params import SamplingParams

KINDS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 1, top-k 50": {"temperature": 1.0, "top_k": 50},
    "temperature 0.7, min-p 0.05": {"temperature": 0.7, "min_p": 0.05},
    "temperature 0.7, presence penalty 0.5": {"temperature": 0.7, "presence_penalty": 0.5},
}
EOS = 2


def zipf_logits(batch: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    """Next-token logits shaped like a language model's (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(batch)]) + 1
    noise = 0.3 * torch.randn(batch, vocab, generator=gen)
    return (-1.2 * torch.log(ranks.float()) + noise).to(device)


def requests_for(batch: int, params: SamplingParams) -> list[Request]:
    """``batch`` one-sequence requests with ``params``, a seed each, a few outputs so far."""
    requests = []
    for i in range(batch):
        req = Request(
            request_id=f"r{i}",
            index=0,
            prompt_token_ids=[5, 6, 7],
            params=params,
            seed=i,
            block_size=16,
            model_id="bench",
            cache_salt=None,
            detokenizer=None,
            max_total_tokens=1 << 20,
        )
        for token in (11, 12, 13):
            req.append_token(token)
        requests.append(req)
    return requests


def step_ms(batch: int, kind: str, vocab: int, device: str, steps: int) -> float:
    """Median wall ms of one ``Sampler.sample`` over ``batch`` rows of ``kind``."""
    params = SamplingParams(max_tokens=1 << 20, **KINDS[kind])
    requests = requests_for(batch, params)
    logits = zipf_logits(batch, vocab, device)
    sampler = Sampler({EOS})
    times_ms = []
    for i in range(steps + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start_s = time.perf_counter()
        sampler.sample(logits, requests)  # the ids reach the host inside
        if i:
            times_ms.append((time.perf_counter() - start_s) * 1000)
    return statistics.median(times_ms)


def measure(batches: list[int], vocab: int, device: str, steps: int, progress=print) -> list:
    rows = []
    for kind in KINDS:
        for batch in batches:
            ms = step_ms(batch, kind, vocab, device, steps)
            rows.append({"kind": kind, "batch": batch, "ms_per_step": round(ms, 3)})
            progress(f"{kind}, batch {batch}: {ms:.2f} ms per step")
    return rows


def plot(rows: list[dict], title: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind in KINDS:
        points = [(r["batch"], r["ms_per_step"]) for r in rows if r["kind"] == kind]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows sampled per step (batch)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sampling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tag", default="", help="appended to the result file's name")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    header = result_header("sampling", "bench.sampling", argv, device=args.device)
    rows = measure(args.batch, args.vocab, args.device, args.steps)
    stem = result_stem("sampling", args.device, args.tag)
    result = {**header, "vocab": args.vocab, "threads": args.threads, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    where = header["device"] if args.device.startswith("cuda") else header["machine"]
    title = f"Sampler per decode step, vocabulary {args.vocab}\n{where}"
    plot(rows, title, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
