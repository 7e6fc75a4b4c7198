"""Shared fixtures: the bundled model (converted once per machine) and tiny random models."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores on CI: one intra-op thread per test process keeps timings sane when Ray or a
# second process runs beside the test.
torch.set_num_threads(int(os.environ.get("PREFIXSERVE_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from worker.loader import resolve_model

    return resolve_model("smollm2").path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_path) -> dict[str, str]:
    """Folders of tiny random-weight models, one per supported architecture."""
    from worker.testing import TINY_ARCHS, make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    models = {arch: make_tiny_model(root / arch, arch, seed=i) for i, arch in enumerate(TINY_ARCHS)}
    models["llama3-scaled"] = make_tiny_model(
        root / "llama3", "llama", seed=7,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    return models
