"""Batch-invariant matmul in Triton: ``x @ weight.T + bias`` with fixed tiles, no split-K.

The Triton twin of ``matmul_ref`` in ``kernels/reference.py``, for deterministic mode on CUDA
(docs/design.md, "Determinism": "kernels that never change their reduction order with the batch
(fixed tiles, no split-K)").

Why a row's result does not depend on M
    Output tile ``(m, n)`` is reduced over K by one program, in ``BLOCK_K`` steps from k = 0
    upwards, each step one ``tl.dot`` of a ``[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]`` tile.
    The tile shape, warp count and pipelining depend on the dtype and the weight's shape
    (``tile_config``), never on M, and there is no split-K, so every output element sees the
    same sequence of operations whether its row is multiplied alone or with 4095 others.
    ``M`` is exempt from Triton's value specialisation (``M == 1``, ``M % 16``), so one
    compiled kernel serves every M. Rows past M are zero-filled by masked loads and never stored.

Persistent grid
    ``min(num_tiles, PROGRAMS_PER_SM * num_SMs)`` programs each walk tiles ``pid, pid +
    num_programs, ...`` in a grouped order (``GROUP_M`` row tiles share a column tile while it
    is hot in L2). Which program computes a tile changes nothing in the tile's arithmetic.

How it fails: ``ValueError`` naming the argument for a wrong shape, dtype or device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_tensor, num_sms, output_or_new, patch_interpreter

patch_interpreter()

TileConfig = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""

# The default per dtype. Half precision: 64-row tiles (one Hopper warpgroup MMA,
# m64n128k16) rather than 128, so a 4096-wide projection at M = 256 already has 128 tiles to
# spread over an H100's 132 SMs. float32 runs IEEE (no TF32) on smaller tiles. Changing a
# config changes the rounding of every row (never its dependence on M).
_CONFIGS: dict[torch.dtype, TileConfig] = {
    torch.float16: (64, 128, 64, 4, 4),
    torch.bfloat16: (64, 128, 64, 4, 4),
    torch.float32: (64, 64, 32, 4, 3),
}
NARROW_OUT_FEATURES = 8192
"""Half precision: weights with at most this many output features get 64-column tiles, so
a decode (one row tile) still spreads over the SMs: a 4096-wide projection has 64 tiles
instead of 32."""
DEEP_IN_FEATURES = 2048
"""Half precision: weights with at least this many input features read 128-deep K steps
(half the loop trips, longer loads in flight)."""


def tile_config(dtype: torch.dtype, out_features: int, in_features: int) -> TileConfig:
    """The tiles of one weight's products: a function of the dtype and the weight's shape,
    never of M, so a row's arithmetic is the same in every batch. Half-precision choices
    come from ``bench/matmul_tiles.py`` on an H100 (Llama-3.1-8B's projections at M = 1, 64
    and 256); float32 keeps its one config."""
    if dtype == torch.float32:
        return _CONFIGS[dtype]
    block_m, block_n, block_k, num_warps, num_stages = _CONFIGS[dtype]
    if out_features <= NARROW_OUT_FEATURES:
        block_n = 64
    if in_features >= DEEP_IN_FEATURES:
        block_k = 128
    return block_m, block_n, block_k, num_warps, num_stages


PROGRAMS_PER_SM = 2
"""Persistent programs per SM: two fit (registers and shared memory), so one's epilogue
overlaps the other's main loop. Which program runs a tile never changes its arithmetic."""
GROUP_M = 8
"""Row tiles walked per column tile, for L2 reuse of weight tiles."""


@triton.jit(do_not_specialize=["M", "num_programs"])
def _bi_matmul_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    bias_ptr,
    M,
    N,
    K,
    num_programs,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    tiles_per_group = GROUP_M * tiles_n
    for tile in range(pid, num_tiles, num_programs):
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % tiles_per_group) % group_rows
        tile_n = (tile % tiles_per_group) // group_rows
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            a = tl.load(x_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=(cols[None, :] < N) & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
        tl.store(
            o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N)
        )


def bi_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias[N])`` -> [M, N] in x's dtype, batch-invariant.

    ``out``, when given, receives the result (and is returned). ``config`` overrides
    ``tile_config`` (for benchmarks that compare tilings).
    """
    check_tensor("x", x, ndim=2)
    num_rows, in_features = x.shape
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), shape=(None, in_features))
    out_features = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), shape=(out_features,))
    out = output_or_new("out", out, x.new_empty(()).expand(num_rows, out_features))
    if num_rows == 0 or out_features == 0:
        return out
    if in_features == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    block_m, block_n, block_k, num_warps, num_stages = config or tile_config(
        x.dtype, out_features, in_features
    )
    num_tiles = triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, block_n)
    num_programs = min(num_tiles, PROGRAMS_PER_SM * num_sms(x.device))
    _bi_matmul_kernel[(num_programs,)](
        out,
        x,
        weight,
        bias if bias is not None else out,
        num_rows,
        out_features,
        in_features,
        num_programs,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=GROUP_M,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
