"""Fused residual-add + RMSNorm in Triton, one program per row.

The Triton twin of ``rms_norm_ref`` in ``kernels/reference.py``: ``residual = x + residual``
(when given, rounded to the activation dtype as torch's add does), then
``normed = rmsnorm(residual) * weight``. The normalised row is rounded to the activation dtype
before the weight multiply, the order of Hugging Face's ``LlamaRMSNorm`` and of the torch CPU
path (``kernels/norm.py``), so the GPU and CPU paths round alike.

Batch invariance: a row's mean of squares is one ``tl.sum`` over a block of
``next_power_of_2(hidden_size)`` elements in one program; the block and warp count depend on
the hidden size only, so a row's result is the same whatever the number of rows.

How it fails: ``ValueError`` naming the argument for a wrong shape, dtype or device, or a
hidden size past ``MAX_HIDDEN_SIZE`` (one row must fit one program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_tensor, output_or_new, patch_interpreter

patch_interpreter()

MAX_HIDDEN_SIZE = 65536
"""One row per program: past this the row no longer fits the registers of one program."""


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    hidden_size,
    stride_out,
    stride_res_out,
    stride_x,
    stride_res,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + row * stride_res_out + cols, x, mask=ok)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / hidden_size
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rmsnorm(x + residual) * weight, x + residual)`` for ``x`` of shape [..., H].

    ``out`` and ``residual_out``, when given (shaped like ``x``), receive the two results.
    """
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the hidden size)")
    hidden_size = x.shape[-1]
    rows = x.reshape(-1, hidden_size)
    check_tensor("x", rows, ndim=2)
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), shape=(hidden_size,))
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        res_rows = residual.reshape(-1, hidden_size)
        check_tensor("residual", res_rows, ndim=2, dtypes=(x.dtype,))
    else:
        res_rows = rows
    if not 0 < hidden_size <= MAX_HIDDEN_SIZE:
        raise ValueError(f"x hidden size must be in 1..{MAX_HIDDEN_SIZE}, got {hidden_size}")
    if rows.stride(-1) != 1 or res_rows.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError("x, residual and weight must be contiguous in the hidden dimension")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")

    out = output_or_new("out", out, x)
    residual_out = output_or_new("residual_out", residual_out, x)
    out_rows, residual_out_rows = out.view(rows.shape), residual_out.view(rows.shape)
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(rows.shape[0],)](
            out_rows,
            residual_out_rows,
            rows,
            res_rows,
            weight,
            eps,
            hidden_size,
            out_rows.stride(0),
            residual_out_rows.stride(0),
            rows.stride(0),
            res_rows.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out, residual_out
