"""Which tiles the batch-invariant matmul should use for a model's projections, on one GPU.

    python -m bench.matmul_tiles [--out FILE] [--rows 1 64 256]

Deterministic mode multiplies every weight with ``bi_matmul`` (``kernels/triton_matmul.py``):
one fixed tile shape per weight, chosen from the dtype and the weight's shape, never from M.
This times candidate tilings (BLOCK_N, BLOCK_K, stages) against cuBLAS (``F.linear``, what
fast mode runs) on the projections of SmolLM2-135M and Llama-3.1-8B (fused QKV, O, fused
gate/up, down, LM head) at decode-sized M, with ``triton.testing.do_bench`` (which flushes L2
between runs, as a model whose weights exceed L2 sees them). Reports per weight shape the
current tiling, the best candidate (least total time over the M values) and cuBLAS, and
writes everything as JSON. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {
    # (out_features N, in_features K)
    "smollm2.qkv": (960, 576),
    "smollm2.o": (576, 576),
    "smollm2.gate_up": (3072, 576),
    "smollm2.down": (576, 1536),
    "smollm2.lm_head": (49152, 576),
    "llama8b.qkv": (6144, 4096),
    "llama8b.o": (4096, 4096),
    "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336),
    "llama8b.lm_head": (128256, 4096),
}
SHARED_MEMORY_BYTES = 200 * 1024


def candidates(block_m: int = 64, elem_bytes: int = 2) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) that fit in shared memory."""
    out = []
    for block_n, block_k, stages in itertools.product((32, 64, 128, 256), (64, 128), (3, 4, 5)):
        stage_bytes = (block_m * block_k + block_k * block_n) * elem_bytes
        if stages * stage_bytes <= SHARED_MEMORY_BYTES:
            out.append((block_m, block_n, block_k, 8 if block_n == 256 else 4, stages))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("matmul_tiles.json"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("matmul_tiles needs a CUDA device", file=sys.stderr)
        return 1
    from triton.testing import do_bench

    from kernels.triton_matmul import bi_matmul, tile_config

    dtype = torch.bfloat16
    results = []
    t0 = time.monotonic()
    for name in args.shapes:
        n, k = SHAPES[name]
        weight = torch.randn(n, k, dtype=dtype, device="cuda") * 0.02
        current = tile_config(dtype, n, k)
        per_config: dict[tuple, list[float]] = {}
        cublas = []
        for m in args.rows:
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            cublas.append(do_bench(lambda x=x, w=weight: F.linear(x, w), warmup=5, rep=20))
            for cfg in candidates():
                try:
                    ms = do_bench(
                        lambda x=x, w=weight, cfg=cfg: bi_matmul(x, w, config=cfg),
                        warmup=5,
                        rep=20,
                    )
                except Exception as exc:  # a tiling this GPU cannot run: skipped, reported
                    print(f"  {name} {cfg}: {type(exc).__name__}: {exc}"[:200], flush=True)
                    ms = float("inf")
                per_config.setdefault(cfg, []).append(ms)
        best = min(per_config, key=lambda c: sum(per_config[c]))
        row = {
            "shape": name,
            "N": n,
            "K": k,
            "rows": args.rows,
            "cublas_ms": cublas,
            "current": list(current),
            "current_ms": per_config.get(current),
            "best": list(best),
            "best_ms": per_config[best],
            "all": [[list(c), v] for c, v in per_config.items()],
        }
        results.append(row)
        print(
            f"{name:16s} N={n:6d} K={k:5d} cuBLAS {' '.join(f'{v:.4f}' for v in cublas)} ms | "
            f"current {current} {' '.join(f'{v:.4f}' for v in row['current_ms'] or [])} | "
            f"best {best} {' '.join(f'{v:.4f}' for v in row['best_ms'])}",
            flush=True,
        )
        args.out.write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1)
        )
    print(f"swept {len(results)} shapes in {time.monotonic() - t0:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
