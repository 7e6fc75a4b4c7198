"""The head of every benchmark's result file, and where a single-run benchmark's file goes.

``result_header`` is the one header maker of ``bench/``: ``benchmark``, ``date`` (UTC, ISO
seconds), ``command`` (how to run it again), ``machine`` (the CPU's model and count, the
line a report's title shows), ``cpu`` and ``cpus`` (the same apart), ``git_commit`` (with
``+dirty`` when tracked files differ from it) and, when the benchmark names one, ``device``
(the GPU's name on CUDA, else the CPU's). Each benchmark adds its own keys beside these.
``result_stem`` is where a single-run benchmark (``bench/host_tier.py``, ``bench/tp.py``, ...)
writes: ``bench/results/<benchmark>_<cpu|cuda>_<UTC date><suffix>``, plus ``.json``/``.png``.

How it fails: the machine facts never raise: ``cpu_model`` falls back to ``platform``'s
names when ``lscpu`` is missing, ``git_commit`` to ``"unknown"`` outside a git checkout.
``device_name`` imports torch, and only for a CUDA device (where torch's errors come through).
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` gives it, else ``platform``'s processor or machine."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def machine_name(cpu: str | None = None) -> str:
    """The CPU's model (``cpu``, else ``cpu_model()``) and logical CPU count, e.g. ``AMD EPYC
    9R14 (2 CPUs)``."""
    return f"{cpu or cpu_model()} ({os.cpu_count()} CPUs)"


def git_commit() -> str:
    """The checkout's HEAD, ``+dirty`` when tracked files differ; ``"unknown"`` without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"


def device_name(device: str) -> str:
    """The GPU's name on CUDA, else the CPU's processor string."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"


def result_header(
    benchmark: str, module: str, argv: list[str] | None = None, device: str | None = None
) -> dict:
    """The common head of a result file (see the module docstring).

    ``module`` is how the benchmark runs: a module (``bench.tp``: ``python -m bench.tp ...``)
    or a script path ending in ``.py`` (``bench/run_sim.py``: ``python bench/run_sim.py ...``);
    ``argv`` its arguments, ``sys.argv[1:]`` when None."""
    args = sys.argv[1:] if argv is None else list(argv)
    launcher = ["python", module] if module.endswith(".py") else ["python", "-m", module]
    cpu = cpu_model()
    header = {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([*launcher, *args]),
        "machine": machine_name(cpu),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "git_commit": git_commit(),
    }
    if device is not None:
        header["device"] = device_name(device)
    return header


def result_stem(benchmark: str, device: str, suffix: str = "") -> Path:
    """``bench/results/<benchmark>_<cpu|cuda>_<date><suffix>``; add ``.json`` or ``.png``."""
    RESULTS.mkdir(exist_ok=True)
    tag = "cuda" if device.startswith("cuda") else "cpu"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return RESULTS / f"{benchmark}_{tag}_{stamp}{suffix}"
