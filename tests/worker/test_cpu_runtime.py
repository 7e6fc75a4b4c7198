"""The engine's process-wide CPU settings (``worker/cpu_runtime.py``)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_allocator_thresholds_are_set_once_per_process():
    # A fresh interpreter: the setting is process-wide, and the test process may have set it.
    code = (
        "from worker.cpu_runtime import configure_cpu_allocator as c; "
        "import torch; first = c(); x = torch.empty(8 * 2**20); del x; print(first, c())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["True", "True"]
