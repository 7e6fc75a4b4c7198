"""Batch-invariant Triton matmul against ``matmul_ref``, and the invariance itself.

Shapes straddle the tile sizes (64 rows for float32, 128 for half precision; K tails that
are not a multiple of BLOCK_K), so the masked edges are exercised. Outputs are pre-filled
with NaN so an unwritten element fails. Under the interpreter the bitwise test holds on any
host BLAS because ``tl.dot`` is patched (``test_triton_interpreter.py``).
"""

from __future__ import annotations

import pytest
import torch

from kernels.reference import matmul_ref
from kernels.triton_matmul import bi_matmul

TOLERANCES = {  # (atol, rtol) for outputs of unit scale
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_problem(rng, num_rows, in_features, out_features, dtype, device, with_bias):
    x = torch.randn(num_rows, in_features, generator=rng) / in_features**0.5
    weight = torch.randn(out_features, in_features, generator=rng)
    bias = torch.randn(out_features, generator=rng) if with_bias else None
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    return x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype), bias


def run(x, weight, bias=None):
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    assert bi_matmul(x, weight, bias, out=out) is out
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    ("num_rows", "in_features", "out_features"), [(1, 80, 48), (130, 200, 70), (65, 32, 129)]
)
def test_matches_reference(rng, device, dtype, with_bias, num_rows, in_features, out_features):
    x, weight, bias = random_problem(
        rng, num_rows, in_features, out_features, dtype, device, with_bias
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        run(x, weight, bias), matmul_ref(x, weight, bias), atol=atol, rtol=rtol
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_bitwise_independent_of_batch_size(rng, device, dtype):
    """Row i of x @ W.T has the same bits whether x has 1 row or 150, at any offset."""
    x, weight, bias = random_problem(rng, 150, 96, 40, dtype, device, with_bias=True)
    full = run(x, weight, bias)
    for num_rows in (1, 2, 5, 63, 64, 65, 128, 129):
        start = int(torch.randint(0, 150 - num_rows + 1, (1,), generator=rng))
        part = run(x[start : start + num_rows], weight, bias)
        assert torch.equal(part, full[start : start + num_rows]), f"rows {start}+{num_rows} differ"


def test_rejects_bad_arguments(rng, device):
    x, weight, bias = random_problem(rng, 4, 32, 16, torch.float16, device, with_bias=True)
    with pytest.raises(ValueError, match="weight"):
        bi_matmul(x, weight[:, :31])
    with pytest.raises(ValueError, match="weight"):
        bi_matmul(x, weight.float())
    with pytest.raises(ValueError, match="bias"):
        bi_matmul(x, weight, bias[:15])
    with pytest.raises(ValueError, match="out"):
        bi_matmul(x, weight, out=torch.empty(4, 15, dtype=x.dtype, device=x.device))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_realistic_sizes_on_gpu(rng, device, dtype):
    """A 4096x4096 projection at M in {1, 64, 256, 1024, 4096}: correct and row-invariant."""
    x, weight, bias = random_problem(rng, 4096, 4096, 4096, dtype, device, with_bias=False)
    full = run(x, weight)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(full, matmul_ref(x, weight), atol=atol, rtol=rtol)
    for num_rows in (1, 64, 256, 1024):
        start = int(torch.randint(0, 4096 - num_rows + 1, (1,), generator=rng))
        assert torch.equal(run(x[start : start + num_rows], weight), full[start : start + num_rows])


def test_tiles_follow_the_weight_not_the_batch():
    """Half precision: narrow weights get 64-column tiles, deep ones 128-deep K steps; the
    choice reads the weight's shape only (there is no M to read)."""
    from kernels.triton_matmul import tile_config

    assert tile_config(torch.bfloat16, 4096, 4096) == (64, 64, 128, 4, 4)
    assert tile_config(torch.bfloat16, 28672, 4096) == (64, 128, 128, 4, 4)
    assert tile_config(torch.bfloat16, 576, 576) == (64, 64, 64, 4, 4)
    assert tile_config(torch.float16, 49152, 576) == (64, 128, 64, 4, 4)
    assert tile_config(torch.float32, 4096, 4096) == (64, 64, 32, 4, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_deep_narrow_weights_are_batch_invariant_too(rng, device, dtype):
    """A weight of the 128-deep, 64-wide tiling (K >= 2048) against the reference and
    across batch sizes, with a K tail that is not a multiple of 128."""
    x, weight, bias = random_problem(rng, 70, 2100, 72, dtype, device, with_bias=False)
    full = run(x, weight)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(full, matmul_ref(x, weight), atol=atol, rtol=rtol)
    for num_rows in (1, 7, 65):
        assert torch.equal(run(x[:num_rows], weight), full[:num_rows])
