"""The common head of a single-run benchmark's result file, and where that file goes.

Each benchmark (``bench/host_tier.py``, ``bench/tp.py``) writes one JSON file and one PNG to
``bench/results/``: ``<benchmark>_<cpu|cuda>_<UTC date><suffix>.json``. Every file starts
with the benchmark's name, the UTC date, the exact command and the device it ran on.
"""

from __future__ import annotations

import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def device_name(device: str) -> str:
    """The GPU's name on CUDA, else the CPU's processor string."""
    return (
        torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    )


def result_header(benchmark: str, module: str, argv: list[str] | None, device: str) -> dict:
    """``benchmark``, ``date``, ``command`` (as ``python -m module ...``) and ``device``."""
    args = argv if argv is not None else sys.argv[1:]
    return {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m", module, *args]),
        "device": device_name(device),
    }


def result_stem(benchmark: str, device: str, suffix: str = "") -> Path:
    """``bench/results/<benchmark>_<cpu|cuda>_<date><suffix>``; add ``.json`` or ``.png``."""
    RESULTS.mkdir(exist_ok=True)
    tag = "cuda" if device.startswith("cuda") else "cpu"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return RESULTS / f"{benchmark}_{tag}_{stamp}{suffix}"
