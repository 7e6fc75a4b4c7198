"""A LoRA group's delta through each backend's deterministic linear (``worker/lora.py``):
a row's bits do not depend on the other rows of its adapter's group. Under the Triton
interpreter here (``conftest.py``); the engine-level tests are ``tests/worker/test_lora.py``."""

from __future__ import annotations

import pytest
import torch

from kernels.ops import select_backend
from tests.kernels.conftest import DEVICE
from worker.lora import LoRABatch


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grouped_delta_rows_are_batch_invariant(backend, rng):
    """Each adapter group's delta through the backend's deterministic linear: a row gets the
    same bits whether its group holds it alone or beside others."""
    device = DEVICE if backend == "triton" else "cpu"
    try:
        ops = select_backend(backend, deterministic=True, device=device)
    except ValueError as exc:
        pytest.skip(str(exc))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=rng).to(device)

    hidden, out_dim, rank = 64, 96, 8
    slot = [
        {"qkv": (ops.prepare_weight(randn(rank, hidden)), ops.prepare_weight(randn(out_dim, rank)))}
    ]
    x = randn(9, hidden)
    together = torch.zeros(9, out_dim, device=device)
    rows = torch.arange(9, device=device)
    LoRABatch([(rows, slot)]).add_delta(ops.linear, x, together, 0, "qkv")
    for row in range(9):
        alone = torch.zeros(1, out_dim, device=device)
        LoRABatch([(rows[:1], slot)]).add_delta(ops.linear, x[row : row + 1], alone, 0, "qkv")
        assert torch.equal(alone[0], together[row])
