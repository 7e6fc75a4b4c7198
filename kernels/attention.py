"""Paged attention on the CPU (torch): a batch-invariant path and a fast path.

Both take a ragged batch (prefill chunks and decodes mixed), so the engine has one call for
every kind of step. The CPU path keeps its cache *head-major*, ``[num_kv_heads, num_blocks,
block_size, head_dim]`` (``kernels/reference.py`` and Triton use block-major): gathering a
sequence's blocks then yields each head's keys as one contiguous ``[keys, head_dim]`` matrix,
with no transposing copy (measured: those copies were 30% of a decode step).

Batch-invariant path (``deterministic=True``)
    torch's CPU GEMMs pick kernels by shape, so a dot product's rounding can change with the
    number of rows in the call. Here every matmul has one fixed shape:
    ``[ATTN_TILE_ROWS, head_dim] @ [head_dim, ATTN_KV_CHUNK]`` for scores and
    ``[ATTN_TILE_ROWS, ATTN_KV_CHUNK] @ [ATTN_KV_CHUNK, head_dim]`` for values, or the same
    with ``SMALL_TILE_ROWS`` rows for chunks that few rows meet, where a startup check
    (``small_tiles_are_exact``) found both row counts give a row the same bits.
    A *row* is one (query token, query head) pair; ``kernels/attention_plan.py`` packs the rows
    that attend to one chunk of ``ATTN_KV_CHUNK`` keys (aligned to position 0) into tiles of
    ``ATTN_TILE_ROWS``, so a chunk shared by many sequences is read once. Each tile's softmax
    over its chunk is computed alone (keys a row may not see get probability exactly 0), and
    each row then folds its chunks' partial results elementwise in ascending chunk order.
    A row meets only the chunks it can see, so a query's output is the same whether it is
    computed in a fresh prefill, after a cache hit, in any chunk of a chunked prefill, or as
    a decode, and whatever shares the batch.

Fast path (``deterministic=False``)
    One ``scaled_dot_product_attention`` call per prefill sequence (its rounding depends on the
    sequence's length); decodes take the tiled path, which reads shared prefix chunks once and
    beat one padded SDPA call over every decode's gathered cache (measured 2x per step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.attention_plan import AttentionPlan, build_plan

ATTN_TILE_ROWS = 16
"""Rows per score tile."""
SMALL_TILE_ROWS = 4
"""Rows per tile of a chunk met by at most this many rows: a decode's own last chunk holds
one token's ``group`` query heads (3 for SmolLM2), which a full tile would pad 16/3-fold.
Used only where ``small_tiles_are_exact``. Measured on a decode step of the engine benchmark
(64 sequences, 1 thread): its 79 private chunks take 1.75 ms per head and layer in 4-row
tiles against 5.5 ms in 16-row ones; the step's whole attention 455 vs 500 ms of CPU."""
ATTN_KV_CHUNK = 128
"""Keys per softmax chunk; a multiple of every supported block size."""
_MASKED = -1.0e30
"""Finite stand-in for -inf so fully masked padding rows never produce NaN."""


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys are, built once per step by the model runner."""

    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32, cumulative query lengths."""
    seq_lens: torch.Tensor
    """[num_seqs] int32, context length including this step's tokens."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32; padded with 0 (never read unmasked)."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64 cache slot of each new token."""
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    plans: dict = field(default_factory=dict, repr=False)
    """Per-step cache of the CPU attention: plans keyed by (block size, group), the fast path's
    decode-only metadata under ``"decodes"``, and gather buffers (``_step_buffer``). Built on
    the first layer, reused by the others."""


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    deterministic: bool,
) -> torch.Tensor:
    """Attention of every query token over its sequence's cache (new K/V already stored)."""
    if deterministic:
        return _attention_tiled(query, k_cache, v_cache, meta, scale)
    return _attention_fast(query, k_cache, v_cache, meta, scale)


def _gather_kv(cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Head-major cache, [..., nblocks] block ids -> [Hkv, ..., nblocks * block_size, D].

    One dim-0 ``index_select`` per KV head: on a contiguous 2-D source torch copies whole
    rows (blocks) with memcpy, measured 4x faster than indexing dim 1 of the 3-D cache, and
    advanced indexing is slower still. ``out`` ([Hkv, blocks.numel(), block_size * D]) is a
    step's reusable buffer: a fresh multi-MB tensor per layer costs its page faults again.
    """
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    ids = blocks.reshape(-1)
    if out is None:
        out = cache.new_empty(num_kv_heads, ids.numel(), block_size * head_dim)
    for h in range(num_kv_heads):
        torch.index_select(cache[h].view(num_blocks, block_size * head_dim), 0, ids, out=out[h])
    return out.view(num_kv_heads, *blocks.shape[:-1], blocks.shape[-1] * block_size, head_dim)


def _step_buffer(meta: AttentionMetadata, key: tuple, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A scratch tensor kept in ``meta.plans`` for the step: every layer reuses it."""
    buf = meta.plans.get(key)
    if buf is None or buf.shape != shape or buf.dtype != like.dtype:
        buf = meta.plans[key] = like.new_empty(shape)
    return buf


@functools.cache
def small_tiles_are_exact(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether this CPU's ``bmm`` gives every row of a ``[SMALL_TILE_ROWS, head_dim]`` tile the
    same bits as the same row in a full ``[ATTN_TILE_ROWS, head_dim]`` tile, for both of the
    attention's products, with the chunk copied or read in place (a stride-0 batch).

    A GEMM library may pick its kernel by the row count (MKL does for 1 and 2 rows, measured),
    so this is checked once per process and shape, on random data, rather than assumed. Where
    it fails every chunk keeps full tiles: slower at decode, equally exact.
    """
    gen = torch.Generator().manual_seed(0)
    small, full, keys = SMALL_TILE_ROWS, ATTN_TILE_ROWS, ATTN_KV_CHUNK
    for _ in range(3):
        q = torch.randn(6, full, head_dim, generator=gen).to(dtype)
        k_t = torch.randn(6, head_dim, keys, generator=gen).to(dtype)
        p = torch.rand(6, full, keys, generator=gen).to(dtype)
        v = torch.randn(6, keys, head_dim, generator=gen).to(dtype)
        for kk, vv in ((k_t, v), (k_t[:1].expand(6, -1, -1), v[:1].expand(6, -1, -1))):
            if not (torch.equal(torch.bmm(q[:, :small].contiguous(), kk), torch.bmm(q, kk)[:, :small])
                    and torch.equal(torch.bmm(p[:, :small].contiguous(), vv), torch.bmm(p, vv)[:, :small])):
                return False
    return True


def plan_for(meta: AttentionMetadata, block_size: int, group: int, head_dim: int, dtype: torch.dtype) -> AttentionPlan:
    """The step's ``AttentionPlan``, built on the first layer and reused by the others."""
    key = (block_size, group)
    plan = meta.plans.get(key)
    if plan is None:
        small = SMALL_TILE_ROWS if group <= SMALL_TILE_ROWS and small_tiles_are_exact(head_dim, dtype) else None
        plan = build_plan(meta.query_start_loc_list, meta.seq_lens_list, meta.block_tables.tolist(),
                          block_size, group, ATTN_TILE_ROWS, ATTN_KV_CHUNK, small)
        meta.plans[key] = plan
    return plan


def _tile_softmax(q, k_t, v, masked, m_out, l_out, o_out) -> None:
    """Tiles ``q [n, T, D]`` against their chunks ``k_t [n, D, C]``, ``v [n, C, D]``; ``masked``
    covers the first tiles only (the others see every key of their chunk).

    ``k_t`` and ``v`` may be one chunk expanded to ``n`` tiles (a stride-0 batch): ``bmm`` then
    multiplies the same fixed ``[T, D] @ [D, C]`` shape per tile without copying the chunk.
    """
    scores = torch.bmm(q, k_t)
    scores[: masked.shape[0]].masked_fill_(masked, _MASKED)  # the tiles that need a mask come first
    torch.amax(scores, dim=-1, keepdim=True, out=m_out)
    p = scores.sub_(m_out).exp_()
    torch.sum(p, dim=-1, keepdim=True, out=l_out)
    torch.bmm(p, v, out=o_out)


def _attention_tiled(query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    plan = plan_for(meta, block_size, group, head_dim, query.dtype)

    # Queries as rows [Hkv, R, D]; each tile set copies them tile-major [Hkv, tiles, T, D].
    qh = (query * scale).view(num_tokens, num_kv_heads, group, head_dim).transpose(0, 1)
    qh = qh.reshape(num_kv_heads, num_tokens * group, head_dim)

    # Each tile's softmax over its chunk alone: max m, sum l and unnormalised output o, per
    # slot; every tile set fills its own slice of the slots.
    m = query.new_empty(num_kv_heads, plan.num_slots, 1)
    l_sum = query.new_empty(num_kv_heads, plan.num_slots, 1)
    o = query.new_empty(num_kv_heads, plan.num_slots, head_dim)
    for s, tiles in enumerate(plan.tile_sets):
        tile, num_tiles = tiles.tile_rows, tiles.num_tiles
        q_tiles = qh.index_select(1, tiles.tile_row_ids).view(num_kv_heads, num_tiles, tile, head_dim)
        slots = slice(tiles.first_slot, tiles.first_slot + tiles.num_slots)
        m_s = m[:, slots].view(num_kv_heads, num_tiles, tile, 1)
        l_s = l_sum[:, slots].view(num_kv_heads, num_tiles, tile, 1)
        o_s = o[:, slots].view(num_kv_heads, num_tiles, tile, head_dim)
        for i, region in enumerate(tiles.regions):
            a, b = region.first, region.first + region.count
            shape = (num_kv_heads, region.blocks.numel(), block_size * head_dim)
            # [Hkv, count, C, D], or [Hkv, C, D] when shared
            k = _gather_kv(k_cache, region.blocks, _step_buffer(meta, ("k", s, i), shape, k_cache))
            v = _gather_kv(v_cache, region.blocks, _step_buffer(meta, ("v", s, i), shape, v_cache))
            if region.shared:  # every tile reads the one chunk in place: a stride-0 batch
                k = k[:, None].expand(-1, region.count, -1, -1)
                v = v[:, None].expand(-1, region.count, -1, -1)
            masked = tiles.tile_masked[a : a + region.num_masked]
            for h in range(num_kv_heads):
                _tile_softmax(q_tiles[h, a:b], k[h].transpose(1, 2), v[h], masked, m_s[h, a:b], l_s[h, a:b], o_s[h, a:b])

    # Fold each row's chunks in ascending order: elementwise, so per row and batch-invariant.
    src0 = plan.merge_src[0]
    run_m, run_l, run_o = m.index_select(1, src0), l_sum.index_select(1, src0), o.index_select(1, src0)
    for rows, src in zip(plan.merge_rows[1:], plan.merge_src[1:], strict=True):
        old_m = run_m if rows is None else run_m.index_select(1, rows)
        old_l = run_l if rows is None else run_l.index_select(1, rows)
        old_o = run_o if rows is None else run_o.index_select(1, rows)
        new_m = m.index_select(1, src)
        both_m = torch.maximum(old_m, new_m)
        a, b = torch.exp(old_m - both_m), torch.exp(new_m - both_m)
        merged_l = old_l * a + l_sum.index_select(1, src) * b
        merged_o = old_o * a + o.index_select(1, src) * b
        if rows is None:
            run_m, run_l, run_o = both_m, merged_l, merged_o
        else:
            run_m.index_copy_(1, rows, both_m)
            run_l.index_copy_(1, rows, merged_l)
            run_o.index_copy_(1, rows, merged_o)
    out = (run_o / run_l).view(num_kv_heads, num_tokens, group, head_dim).transpose(0, 1)
    return out.reshape(num_tokens, num_heads, head_dim)


def _attention_fast(query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    block_size = k_cache.shape[2]
    qsl, lens = meta.query_start_loc_list, meta.seq_lens_list
    out = torch.empty_like(query)
    decodes = [s for s in range(len(lens)) if qsl[s + 1] - qsl[s] == 1]
    for s in range(len(lens)):
        q_len = qsl[s + 1] - qsl[s]
        if q_len == 1:
            continue
        nb = -(-lens[s] // block_size)
        k = _gather_kv(k_cache, meta.block_tables[s, :nb].long())[:, : lens[s]]  # [Hkv, L, D]
        v = _gather_kv(v_cache, meta.block_tables[s, :nb].long())[:, : lens[s]]
        q_pos = torch.arange(lens[s] - q_len, lens[s])
        mask = torch.arange(lens[s])[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            query[qsl[s] : qsl[s + 1]].transpose(0, 1), k, v,
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[qsl[s] : qsl[s + 1]] = o.transpose(0, 1)
    if decodes:
        # Decodes share prefix chunks: the tiled path reads each shared chunk once.
        sub = meta.plans.get("decodes")
        if sub is None:
            sub = meta.plans["decodes"] = AttentionMetadata(
                query_start_loc=torch.arange(len(decodes) + 1, dtype=torch.int32),
                seq_lens=meta.seq_lens[decodes], block_tables=meta.block_tables[decodes],
                slot_mapping=meta.slot_mapping[:0], query_start_loc_list=list(range(len(decodes) + 1)),
                seq_lens_list=[lens[s] for s in decodes],
            )
        rows = torch.tensor([qsl[s] for s in decodes])
        out[rows] = _attention_tiled(query[rows], k_cache, v_cache, sub, scale)
    return out
