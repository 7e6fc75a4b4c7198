"""Neox-style rotary embedding in Triton, one program per token for all its heads.

The Triton twin of ``rotary_ref`` in ``kernels/reference.py``: each head's two halves
``(x1, x2)`` become ``(x1 cos - x2 sin, x2 cos + x1 sin)`` with ``cos, sin`` read from row
``positions[i]`` of ``cos_sin_cache`` ``[max_positions, head_dim]`` (``cat(cos, sin)``). The
table, Llama 3 rope scaling included, is built by ``build_cos_sin_cache`` in
``kernels/rotary.py``; this kernel only applies it. Arithmetic is float32; results are new
tensors in the input dtype. Elementwise, so batch-invariant by construction.

How it fails: ``ValueError`` naming the argument for a wrong shape, dtype or device, or an
odd head dim. Positions are not bounds-checked on the device (a host sync per step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_tensor, output_or_new, patch_interpreter

patch_interpreter()

NUM_WARPS = 4
"""Warps per token: (Hq + Hkv) * D elements, a few KiB, bandwidth-bound."""


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    src_stride_t,
    src_stride_h,
    dst_stride_t,
    dst_stride_h,
    token,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    ok = (heads < NUM_HEADS) & (dims < HALF)
    src = src_ptr + token * src_stride_t + heads * src_stride_h + dims
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = dst_ptr + token * dst_stride_t + heads * dst_stride_h + dims
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=ok)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=ok)


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims, mask=dims < HALF, other=0.0)
    sin = sin.to(tl.float32)
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        token,
        cos,
        sin,
        NUM_Q_HEADS,
        Q_HEADS_PAD,
        HALF,
        HALF_PAD,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        token,
        cos,
        sin,
        NUM_K_HEADS,
        K_HEADS_PAD,
        HALF,
        HALF_PAD,
    )


def rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    query_out: torch.Tensor | None = None,
    key_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` [N, Hq, D] and ``key`` [N, Hkv, D] at ``positions``.

    Returns ``(query_out, key_out)``: new tensors, or the given ones filled in.
    """
    check_tensor("query", query, ndim=3)
    num_tokens, num_q_heads, head_dim = query.shape
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,), shape=(num_tokens, None, head_dim))
    check_tensor(
        "positions", positions, ndim=1, dtypes=(torch.int64, torch.int32), shape=(num_tokens,)
    )
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, shape=(None, head_dim))
    if head_dim % 2:
        raise ValueError(f"query head_dim must be even, got {head_dim}")
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if not positions.is_contiguous():
        raise ValueError("positions must be contiguous")
    q_out = output_or_new("query_out", query_out, query)
    k_out = output_or_new("key_out", key_out, key)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    num_k_heads = key.shape[1]
    _rotary_kernel[(num_tokens,)](
        q_out,
        k_out,
        query,
        key,
        positions,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=NUM_WARPS,
    )
    return q_out, k_out
