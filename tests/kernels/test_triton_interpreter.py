"""The interpreter's ``tl.dot`` (``kernels/triton_common.patch_interpreter``) keeps a GPU's
property.

On the CPU the Triton kernels run in Triton's interpreter, where ``tl.dot`` would be numpy's
``matmul``, i.e. the host's BLAS. OpenBLAS's AVX2 ("Haswell") sgemm, picked on AMD EPYC VMs
without AVX-512, rounds an element differently depending on where its row falls in the
matrix, so the kernels' bitwise batch-invariance tests failed there for reasons outside the
kernels. The patched dot sums each element's products in one fixed order, as an MMA unit
does for every element of a tile; these tests pin that down, so the invariance tests in
``test_triton_attention.py`` and ``test_triton_matmul.py`` test what the kernels control
(tile shapes and reduction order) on AVX2 and AVX-512 hosts alike.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.triton_common import _position_independent_dot

ROW_SHIFTS = (1, 2, 3, 5, 8, 16, 33)


def _random(rng: torch.Generator, *shape: int) -> np.ndarray:
    return torch.randn(*shape, generator=rng).numpy()


def test_element_bits_do_not_depend_on_its_position_or_the_matrix_size(rng):
    a, b = _random(rng, 64, 128), _random(rng, 128, 64)
    full = _position_independent_dot(a, b, np.float32)
    for shift in ROW_SHIFTS:
        moved_rows = _position_independent_dot(np.roll(a, shift, 0), b, np.float32)
        assert np.array_equal(np.roll(full, shift, 0), moved_rows), f"row shift {shift}"
        moved_cols = _position_independent_dot(a, np.roll(b, shift, 1), np.float32)
        assert np.array_equal(np.roll(full, shift, 1), moved_cols), f"column shift {shift}"
    for num_rows in (1, 2, 3, 17, 63):
        part = _position_independent_dot(a[:num_rows], b, np.float32)
        assert np.array_equal(part, full[:num_rows]), f"{num_rows} rows"


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_matches_matmul_within_rounding(rng, dtype):
    a, b = _random(rng, 32, 96).astype(dtype), _random(rng, 96, 48).astype(dtype)
    got = _position_independent_dot(a, b, np.float32)
    assert got.dtype == np.float32
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_batched_operands(rng):
    a, b = _random(rng, 3, 8, 16), _random(rng, 3, 16, 4)
    got = _position_independent_dot(a, b, np.float32)
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5)
