"""Triton kernel speed on one CUDA device: paged attention and the batch-invariant matmul.

Measures, in one table:
    * device-to-device copy bandwidth (``dst.copy_(src)`` of ``COPY_BYTES``; read + write);
    * decode attention (batch ``--decode-batch`` x ``--context`` tokens): time and achieved
      GB/s over the K/V bytes it must read, as a fraction of the measured copy bandwidth
      (target: >= ``DECODE_TARGET_FRACTION`` at batch 64 with 4k contexts);
    * prefill attention (``--prefill-seqs`` fresh sequences of ``--context`` tokens): time
      and causal TFLOP/s;
    * ``bi_matmul`` against ``torch.matmul`` (``x @ W.T``, cuBLAS) at M in ``MATMUL_ROWS``
      for a ``--hidden`` x ``--hidden`` weight: TFLOP/s and ratio (target: within
      ``MATMUL_TARGET_GAP`` of torch at M >= 256).
Shapes default to Llama-3-8B (32 query heads, 8 KV heads, head dim 128, block size 16, bf16).
Timings are medians of ``triton.testing.do_bench`` (which flushes L2 between runs).

Writes ``bench/results/kernels_<device>.json`` (device, date, command, versions, numbers,
targets met) and a PNG beside it. Without a CUDA device it exits with status 1 and says so;
it never falls back to the interpreter, whose timings would mean nothing.

    python -m bench.kernels [--context 4096] [--decode-batch 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).parent / "results"
COPY_BYTES = 1 << 30  # 1 GiB: far past L2 (50-60 MB on H100/H200), so it measures HBM
MATMUL_ROWS = (1, 64, 256, 1024, 4096)
DECODE_TARGET_FRACTION = 0.70  # target: decode attention at >= 70% of copy bandwidth
MATMUL_TARGET_GAP = 0.15  # target: bi_matmul within 15% of torch at M >= 256
MATMUL_TARGET_MIN_ROWS = 256
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B attention


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth_gbs() -> dict:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return {"bytes": COPY_BYTES, "ms": ms, "gb_per_s": 2 * COPY_BYTES / ms / 1e6}


def paged_batch(q_lens: list[int], ctx_lens: list[int], dtype: torch.dtype):
    """Queries and a paged cache whose blocks are shuffled, as a long-running pool leaves them."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in ctx_lens]
    num_blocks = sum(blocks_per_seq)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    order = torch.randperm(num_blocks, device="cuda").int()
    tables = torch.zeros(len(ctx_lens), max(blocks_per_seq), dtype=torch.int32, device="cuda")
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = order[used : used + n]
        used += n
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    query = torch.randn(starts[-1], NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    return query, k_cache, v_cache, tables, qsl, seq_lens


def bench_decode(batch: int, context: int, dtype: torch.dtype, copy_gbs: float) -> dict:
    from kernels.triton_attention import paged_attention

    args = paged_batch([1] * batch, [context] * batch, dtype)
    ms = bench_ms(lambda: paged_attention(*args, HEAD_DIM**-0.5))
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * args[1].element_size()
    gbs = kv_bytes / ms / 1e6
    return {
        "batch": batch,
        "context": context,
        "ms": ms,
        "gb_per_s": gbs,
        "fraction_of_copy": gbs / copy_gbs,
        "target_met": gbs / copy_gbs >= DECODE_TARGET_FRACTION,
    }


def bench_prefill(num_seqs: int, context: int, dtype: torch.dtype) -> dict:
    from kernels.triton_attention import paged_attention

    args = paged_batch([context] * num_seqs, [context] * num_seqs, dtype)
    ms = bench_ms(lambda: paged_attention(*args, HEAD_DIM**-0.5))
    # QK^T and PV over the causal triangle, 2 FLOPs per multiply-add.
    flops = num_seqs * 2 * 2 * NUM_HEADS * HEAD_DIM * context * (context + 1) / 2
    return {"seqs": num_seqs, "context": context, "ms": ms, "tflop_per_s": flops / ms / 1e9}


def bench_matmul(hidden: int, dtype: torch.dtype) -> list[dict]:
    from kernels.triton_matmul import bi_matmul

    weight = torch.randn(hidden, hidden, dtype=dtype, device="cuda") / hidden**0.5
    rows = []
    for num_rows in MATMUL_ROWS:
        x = torch.randn(num_rows, hidden, dtype=dtype, device="cuda")
        ours_ms = bench_ms(lambda x=x: bi_matmul(x, weight))
        torch_ms = bench_ms(lambda x=x: torch.matmul(x, weight.T))
        flops = 2 * num_rows * hidden * hidden
        ratio = torch_ms / ours_ms  # bi_matmul throughput as a fraction of torch's
        rows.append(
            {
                "m": num_rows,
                "n": hidden,
                "k": hidden,
                "bi_matmul_ms": ours_ms,
                "torch_ms": torch_ms,
                "bi_matmul_tflop_per_s": flops / ours_ms / 1e9,
                "torch_tflop_per_s": flops / torch_ms / 1e9,
                "throughput_vs_torch": ratio,
                "target_met": None
                if num_rows < MATMUL_TARGET_MIN_ROWS
                else ratio >= 1 - MATMUL_TARGET_GAP,
            }
        )
    return rows


def print_table(result: dict) -> None:
    copy, dec, pre = result["copy"], result["decode"], result["prefill"]
    print(f"device: {result['device']}  dtype: {result['dtype']}  date: {result['date']}")
    print(f"{'what':<44}{'ms':>10}{'GB/s':>10}{'TFLOP/s':>10}{'vs ref':>10}")
    print(f"{'copy 1 GiB (read+write)':<44}{copy['ms']:>10.3f}{copy['gb_per_s']:>10.0f}")
    label = f"decode attn b={dec['batch']} ctx={dec['context']}"
    print(
        f"{label:<44}{dec['ms']:>10.3f}{dec['gb_per_s']:>10.0f}{'':>10}{dec['fraction_of_copy']:>10.2f}"
    )
    label = f"prefill attn {pre['seqs']}x{pre['context']} causal"
    print(f"{label:<44}{pre['ms']:>10.3f}{'':>10}{pre['tflop_per_s']:>10.1f}")
    for row in result["matmul"]:
        label = f"bi_matmul M={row['m']} N=K={row['n']} (torch)"
        print(
            f"{label:<44}{row['bi_matmul_ms']:>10.3f}{'':>10}"
            f"{row['bi_matmul_tflop_per_s']:>5.0f}/{row['torch_tflop_per_s']:<4.0f}"
            f"{row['throughput_vs_torch']:>10.2f}"
        )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mm, ax_attn) = plt.subplots(1, 2, figsize=(11, 4))
    ms = [r["m"] for r in result["matmul"]]
    ax_mm.plot(ms, [r["bi_matmul_tflop_per_s"] for r in result["matmul"]], "o-", label="bi_matmul")
    ax_mm.plot(ms, [r["torch_tflop_per_s"] for r in result["matmul"]], "s--", label="torch.matmul")
    ax_mm.set(
        xscale="log",
        xlabel="M (rows)",
        ylabel="TFLOP/s",
        title=f"matmul N=K={result['matmul'][0]['n']}",
    )
    ax_mm.legend()
    dec = result["decode"]
    ax_attn.bar(["copy", "decode attn"], [result["copy"]["gb_per_s"], dec["gb_per_s"]])
    ax_attn.axhline(
        DECODE_TARGET_FRACTION * result["copy"]["gb_per_s"], ls=":", c="k", label="70% target"
    )
    ax_attn.set(ylabel="GB/s", title=f"decode b={dec['batch']} ctx={dec['context']}")
    ax_attn.legend()
    fig.suptitle(f"{result['device']}, {result['dtype']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--prefill-seqs", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096, help="matmul N = K")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench/kernels.py needs a CUDA device: the Triton kernels only run compiled on a GPU "
            "(the CPU interpreter's timings would mean nothing). Nothing measured.",
            file=sys.stderr,
        )
        return 1
    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name()
    import triton

    copy = copy_bandwidth_gbs()
    result = {
        "device": device_name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", "bench.kernels", *sys.argv[1:]]),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "shapes": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
        },
        "copy": copy,
        "decode": bench_decode(args.decode_batch, args.context, dtype, copy["gb_per_s"]),
        "prefill": bench_prefill(args.prefill_seqs, args.context, dtype),
        "matmul": bench_matmul(args.hidden, dtype),
    }
    print_table(result)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"kernels_{slug}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, json_path.with_suffix(".png"))
    print(f"wrote {json_path} and {json_path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
