"""Writing new tokens' K/V into the paged cache through a slot mapping, in Triton.

The Triton twin of ``store_kv_ref`` in ``kernels/reference.py``: token ``i`` goes to block
``slot_mapping[i] // block_size``, offset ``slot_mapping[i] % block_size``; a slot < 0 is
padding and is skipped. One program per token copies its ``[Hkv, D]`` rows of K and V; a
copy has no reduction, so the result never depends on the batch.

How it fails: ``ValueError`` naming the argument for a wrong shape, dtype or device. Slots
are not bounds-checked on the device (that would cost a host sync per step); the engine's
block pool only hands out slots inside the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_tensor, patch_interpreter

patch_interpreter()

NUM_WARPS = 4
"""Warps per token: a copy of Hkv * D elements (2-8 KiB in half precision) is bandwidth-bound."""


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    ok = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kt + heads * stride_kh + dims, mask=ok)
    v = tl.load(value_ptr + src * stride_vt + heads * stride_vh + dims, mask=ok)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims
    tl.store(k_dst, k, mask=ok)
    tl.store(v_dst, v, mask=ok)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[N, Hkv, D]`` into the caches at ``slot_mapping`` (< 0: skip)."""
    check_tensor("k_cache", k_cache, ndim=4)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape))
    check_tensor("key", key, ndim=3, dtypes=(k_cache.dtype,), shape=(None, num_kv_heads, head_dim))
    num_tokens = key.shape[0]
    check_tensor("value", value, ndim=3, dtypes=(k_cache.dtype,), shape=tuple(key.shape))
    check_tensor(
        "slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), shape=(num_tokens,)
    )
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=NUM_WARPS,
    )
