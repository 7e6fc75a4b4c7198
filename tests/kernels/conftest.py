"""Kernel tests: run Triton kernels on the CPU interpreter when no CUDA device is present.

``TRITON_INTERPRET=1`` must be set before the kernel modules decorate their ``@triton.jit``
functions, so it is set here, at collection, before any test module imports them. Tests
marked ``cuda`` (realistic sizes) are skipped without a CUDA device. Every test draws fresh
inputs from its own ``rng`` generator, seeded with the test's seed (``tests/conftest.py``:
a failure's report names it, and ``PREFIXSERVE_TEST_SEED=<seed>`` replays it).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the Triton kernels run: the GPU when present, else the CPU interpreter."""


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    here = os.path.dirname(__file__)
    for item in items:
        if "cuda" in item.keywords and str(item.path).startswith(here):
            item.add_marker(skip)


@pytest.fixture
def rng(test_seed: int) -> torch.Generator:
    """A generator seeded with this test's seed, which a failure's report names."""
    return torch.Generator().manual_seed(test_seed)


@pytest.fixture
def device() -> str:
    return DEVICE
