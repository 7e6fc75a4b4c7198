"""Unified paged attention in Triton: prefill chunks and decodes of a ragged batch, one kernel.

Layout and meaning are those of ``paged_attention_ref`` in ``kernels/reference.py``: queries
``[num_tokens, Hq, D]`` packed by ``query_start_loc``, K/V in ``[num_blocks, block_size, Hkv,
D]`` pages found through ``block_tables``, ``seq_lens`` counting the new tokens, causal.

Work split
    One program per (query tile of one sequence, KV head). A tile holds ``BLOCK_Q`` query
    tokens times the ``group = Hq // Hkv`` query heads of that KV head, as the rows of one
    ``[BLOCK_M, D]`` matrix (row ``r`` = token ``r // GROUP_PAD``, head ``r % GROUP_PAD``), so
    every K/V chunk loaded is shared by all heads of the group (GQA/MQA). The program finds
    its sequence by a binary search over ``query_start_loc`` on the device: no host sync.

Determinism contract (docs/design.md, "Determinism"): "attention over the paged cache in
fixed-size KV chunks in one order for prefill and decode alike". It holds because
    * the KV sequence is reduced by an online softmax in chunks of ``KV_CHUNK`` keys, a
      constant, starting at position 0 and always ascending; no split-K, no split count;
    * the tile shape (``BLOCK_M``, ``KV_CHUNK``, ``num_warps``) depends only on the model
      (head dim, group size, dtype), never on the batch, so every ``tl.dot`` and row
      reduction a query row takes part in has the same shape and order whatever else is in
      its tile: a decode, a prefill chunk, or another sequence's padding;
    * keys a row may not see get probability exactly 0, and a chunk wholly past a row's
      position leaves its max, sum and accumulator unchanged (``x * 1.0 + 0.0``), so the
      chunks a tile runs for its other rows never touch this row's result.
    Hence a query's output is bitwise the same alone or in any batch, and whether its
    position is computed in a prefill, a chunked-prefill piece or a decode;
    ``tests/kernels/test_triton_attention.py`` checks both.

8-bit caches (``kv_cache_dtype`` ``int8`` or ``fp8_e4m3``, ``kernels/kv_quant.py``)
    The caches are uint8 ``[num_blocks, block_size, Hkv, D + 2]``: each row's ``D`` 8-bit
    values, then its float16 scale at byte ``D`` (2-byte aligned: ``D`` and the strides are
    even). ``_paged_attention_quant_kernel`` is the same program (``_attend``) with the K
    and V loads replaced by: load the value bytes and the row's scale, read back
    ``float32(value) * float32(scale)`` (exact: 7 or 4 bits times 11 fit float32), round to
    the query's dtype, as ``kv_quant.dequantize_rows`` does. Everything after the loads is
    unchanged, in the query's dtype, so the determinism contract holds as above (the
    read-back is elementwise). float8_e4m3fn bytes are decoded by bit operations
    (``fp8e4m3_to_float`` in ``kernels/triton_cache.py``), exact everywhere.
    The full-precision kernel keeps its own entry point and signature, so its compiled code
    is what it was.

How it fails: ``ValueError`` naming the argument for a wrong shape, dtype or device, an
unknown ``kv_cache_dtype``, or a block size that does not divide ``KV_CHUNK``. Indices are
not bounds-checked on the device (that would cost a host sync per step): a block table
pointing past the cache, or a ``query_start_loc[-1]`` past ``num_tokens``, reads out of
bounds, as in every paged-attention kernel. The engine's block pool and scheduler build both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import SCALE_BYTES, kv_format
from kernels.triton_cache import (
    KV_QUANT_CODES,
    check_scale_alignment,
    fp8e4m3_to_float,
)
from kernels.triton_common import check_tensor, output_or_new, patch_interpreter

patch_interpreter()

KV_CHUNK = 64
"""Keys per online-softmax step: fixed so the reduction order never depends on the batch;
a multiple of the supported block sizes (16, 32) and wide enough for tensor-core dots."""
BLOCK_M = 64
"""Rows (query tokens x group heads) per program. Fixed per model for the same reason; 64
keeps prefill K/V reuse high, while a decode wastes compute, not memory traffic."""
NUM_WARPS = 4
"""Warps per program: fixed, since the layout decides the order of the row reductions."""
LOG2E = 1.4426950408889634
"""exp(x) == exp2(x * log2(e)); the kernel works in base 2."""


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest s with query_start_loc[s] // BLOCK_Q + s <= pid (tiles of earlier sequences)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dequantize(raw, scale, KV_QUANT: tl.constexpr):
    """8-bit values (their bytes, uint8) times their rows' float16 scales, in float32."""
    if KV_QUANT == 1:
        values = raw.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        values = fp8e4m3_to_float(raw)
    return values * scale.to(tl.float32)


@triton.jit
def _attend(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_seqs,
    qk_scale_log2,
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    KV_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_start = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP_PAD  # token index within the sequence's query
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx_len - q_len + tok  # padding rows get positions >= ctx_len: they stay finite
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    last_pos = ctx_len - q_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    keys = tl.arange(0, KV_CHUNK)
    for chunk_start in range(0, last_pos + 1, KV_CHUNK):
        k_pos = chunk_start + keys
        k_ok = k_pos <= last_pos
        page = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        page = page.to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k_offs = page * stride_kb + slot * stride_ko + kv_head * stride_kh
        k_ptrs = k_cache_ptr + k_offs[None, :] + dims[:, None]
        k_mask = k_ok[None, :] & dim_ok[:, None]
        if KV_QUANT == 0:
            kt = tl.load(k_ptrs, mask=k_mask, other=0.0)  # [HEAD_DIM_PAD, KV_CHUNK]
        else:
            k_scale_ptrs = (k_cache_ptr + k_offs + HEAD_DIM).to(tl.pointer_type(tl.float16))
            k_scale = tl.load(k_scale_ptrs, mask=k_ok, other=0.0)
            k_bytes = tl.load(k_ptrs, mask=k_mask, other=0)
            kt = _dequantize(k_bytes, k_scale[None, :], KV_QUANT).to(q_ptr.dtype.element_ty)
        scores = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx_len)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_offs = page * stride_vb + slot * stride_vo + kv_head * stride_vh
        v_ptrs = v_cache_ptr + v_offs[:, None] + dims[None, :]
        v_mask = k_ok[:, None] & dim_ok[None, :]
        if KV_QUANT == 0:
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # [KV_CHUNK, HEAD_DIM_PAD]
        else:
            v_scale_ptrs = (v_cache_ptr + v_offs + HEAD_DIM).to(tl.pointer_type(tl.float16))
            v_scale = tl.load(v_scale_ptrs, mask=k_ok, other=0.0)
            v_bytes = tl.load(v_ptrs, mask=v_mask, other=0)
            v = _dequantize(v_bytes, v_scale[:, None], KV_QUANT).to(q_ptr.dtype.element_ty)
        p_v = p.to(q_ptr.dtype.element_ty)  # the cache's dtype when not quantized
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
    tl.store(
        out_ptr + o_offs + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


# Batch-dependent integers are not value-specialised (== 1, % 16), so one compiled kernel
# serves every batch of a model.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_seqs,
    qk_scale_log2,
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    KV_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Attention over a full-precision cache (K/V in the query's dtype)."""
    _attend(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        num_seqs,
        qk_scale_log2,
        stride_ot,
        stride_oh,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ko,
        stride_kh,
        stride_vb,
        stride_vo,
        stride_vh,
        stride_bt,
        GROUP,
        GROUP_PAD,
        HEAD_DIM,
        HEAD_DIM_PAD,
        BLOCK_SIZE,
        BLOCK_M,
        BLOCK_Q,
        KV_CHUNK,
        DOT_PRECISION,
        0,
    )


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_quant_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_seqs,
    qk_scale_log2,
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    KV_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Attention over an 8-bit cache: ``KV_QUANT`` 1 is int8, 2 is fp8_e4m3."""
    _attend(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        num_seqs,
        qk_scale_log2,
        stride_ot,
        stride_oh,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ko,
        stride_kh,
        stride_vb,
        stride_vo,
        stride_vh,
        stride_bt,
        GROUP,
        GROUP_PAD,
        HEAD_DIM,
        HEAD_DIM_PAD,
        BLOCK_SIZE,
        BLOCK_M,
        BLOCK_Q,
        KV_CHUNK,
        DOT_PRECISION,
        KV_QUANT,
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_cache_dtype: str = "auto",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch over the paged cache; returns ``[N, Hq, D]``.

    ``out``, when given, receives the result (and is returned). Every row up to
    ``query_start_loc[-1]`` is written; rows past it (padding) are left as they were. With
    an 8-bit ``kv_cache_dtype`` the caches are uint8 ``[..., Hkv, D + 2]`` rows
    (``kernels/kv_quant.py``); ``auto``: K/V in the query's dtype.
    """
    check_tensor("query", query, ndim=3)
    num_tokens, num_heads, head_dim = query.shape
    fmt = kv_format(kv_cache_dtype)
    cache_dtype = torch.uint8 if fmt.quantized else query.dtype
    width = head_dim + SCALE_BYTES if fmt.quantized else head_dim
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(cache_dtype,), shape=(None, None, None, width))
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(cache_dtype,), shape=tuple(k_cache.shape))
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    num_seqs = seq_lens.shape[0]
    check_tensor(
        "block_tables", block_tables, ndim=2, dtypes=(torch.int32,), shape=(num_seqs, None)
    )
    check_tensor(
        "query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), shape=(num_seqs + 1,)
    )
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of k_cache heads ({num_kv_heads})"
        )
    if block_size <= 0 or KV_CHUNK % block_size:
        raise ValueError(f"k_cache block size {block_size} must divide KV_CHUNK={KV_CHUNK}")
    if head_dim < 16 or head_dim % 2:
        raise ValueError(f"query head_dim must be an even number >= 16, got {head_dim}")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if fmt.quantized:
        check_scale_alignment("k_cache", k_cache)
        check_scale_alignment("v_cache", v_cache)
    if (
        block_tables.stride(1) != 1
        or not query_start_loc.is_contiguous()
        or not seq_lens.is_contiguous()
    ):
        raise ValueError("block_tables rows, query_start_loc and seq_lens must be contiguous")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")

    out = output_or_new("out", out, query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(BLOCK_M, group_pad)
    block_q = block_m // group_pad
    # Each sequence owns tiles [qsl[s] // BLOCK_Q + s, qsl[s + 1] // BLOCK_Q + s + 1): enough
    # for its ceil(q_len / BLOCK_Q) tiles, with no host sync to count them.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    if fmt.quantized:
        kernel = _paged_attention_quant_kernel[grid]
        extra = {"KV_QUANT": KV_QUANT_CODES[fmt.name]}
    else:
        kernel, extra = _paged_attention_kernel[grid], {}
    kernel(
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        num_seqs,
        scale * LOG2E,
        out.stride(0),
        out.stride(1),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        KV_CHUNK=KV_CHUNK,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=2,
        **extra,
    )
    return out
