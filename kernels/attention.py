"""Paged attention on the CPU (torch): a batch-invariant path and a fast path.

Both take a ragged batch (prefill chunks and decodes mixed), so the engine has one call for
every kind of step. The CPU path keeps its cache *head-major*, ``[num_kv_heads, num_blocks,
block_size, head_dim]`` (``kernels/reference.py`` and Triton use block-major): gathering a
sequence's blocks then yields each head's keys as one contiguous ``[keys, head_dim]`` matrix,
with no transposing copy per step (one VM's measurements of these choices:
``bench/results/cpu_kernel_measurements.md``).

Batch-invariant path (``deterministic=True``)
    torch's CPU GEMMs pick kernels by shape, so a dot product's rounding can change with the
    number of rows in the call. Here every matmul has a fixed shape:
    ``[T, head_dim] @ [head_dim, ATTN_KV_CHUNK]`` for scores and
    ``[T, ATTN_KV_CHUNK] @ [ATTN_KV_CHUNK, head_dim]`` for values, where T is the reference
    ``ATTN_TILE_ROWS`` or a smaller row count that a startup probe (``exact_tile_rows``) found
    to give every row the reference's bits on this CPU.
    A *row* is one (query token, query head) pair; ``kernels/attention_plan.py`` packs the rows
    that attend to one chunk of ``ATTN_KV_CHUNK`` keys (aligned to position 0) into tiles (full
    ones, and the smallest exact one for the rest), so a chunk shared by many sequences is
    read once. Each tile's softmax over its chunk is computed alone (keys a row may not see get
    probability exactly 0), and each row then folds its chunks' partial results elementwise in
    ascending chunk order. A row meets only the chunks it can see, so a query's output is the
    same whether it is computed in a fresh prefill, after a cache hit, in any chunk of a
    chunked prefill, or as a decode, and whatever shares the batch.
    Per-call overhead dominates a small batch's attention, so a region of tiles is one
    ``bmm`` over every KV head (a head-major batch), its keys one gather for all heads, and the
    fold one pass per chunk index over all rows.

8-bit KV (``kernels/kv_quant.py``)
    With a quantized cache each gather copies the rows' bytes (a quarter of float32's), then
    reads them back into the query's dtype (``dequantize_rows``: value times the row's own
    scale, elementwise) before the same matmuls: the batch invariance above is untouched.

Fast path (``deterministic=False``)
    One ``scaled_dot_product_attention`` call per prefill sequence (its rounding depends on the
    sequence's length); decodes take the tiled path, which reads shared prefix chunks once,
    where one padded SDPA call would read every decode's gathered cache in full.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.attention_plan import AttentionPlan, build_plan
from kernels.kv_quant import FORMATS, KVFormat, dequantize_rows
from kernels.linear import cpu_description

log = logging.getLogger(__name__)

ATTN_TILE_ROWS = 16
"""Rows of the reference score tile, whose bits every tile size used must reproduce."""
ATTN_TILE_LADDER_ROWS = (1, 2, 4, 8)
"""Smaller tile row counts ``exact_tile_rows`` tries. A chunk that few rows meet (a decode's own
last chunk: one token's ``group`` query heads, 3 for SmolLM2; a prompt's chunk shared by two
decodes: 6) gets the smallest exact tile that holds them instead of a mostly padded full one."""
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
    decode-only metadata and rows under ``"decodes"``, and gather buffers (``_step_buffer``).
    Built on the first layer, reused by the others."""


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    deterministic: bool,
    fmt: KVFormat = FORMATS["auto"],
) -> torch.Tensor:
    """Attention of every query token over its sequence's cache (new K/V already stored);
    ``fmt``: how the cache stores its rows."""
    if deterministic:
        return _attention_tiled(query, k_cache, v_cache, meta, scale, fmt)
    return _attention_fast(query, k_cache, v_cache, meta, scale, fmt)


def _gather_kv(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    out: torch.Tensor | None = None,
    fmt: KVFormat = FORMATS["auto"],
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Head-major cache, [..., nblocks] block ids -> [Hkv, ..., nblocks * block_size, D]; rows
    of an 8-bit cache (``fmt``) are read back as ``dtype``.

    One dim-0 ``index_select`` per KV head: on a contiguous 2-D source torch copies whole
    rows (blocks) with memcpy, which beat indexing dim 1 of the 3-D cache and advanced
    indexing (``bench/results/cpu_kernel_measurements.md``). ``out`` ([Hkv, blocks.numel(),
    block_size * D]) is a step's reusable buffer: a fresh multi-MB tensor per layer costs its
    page faults again.
    """
    num_kv_heads, num_blocks, block_size, width = cache.shape
    ids = blocks.reshape(-1)
    if out is None:
        out = cache.new_empty(num_kv_heads, ids.numel(), block_size * width)
    for h in range(num_kv_heads):
        torch.index_select(cache[h].view(num_blocks, block_size * width), 0, ids, out=out[h])
    if fmt.quantized:
        out = dequantize_rows(out.view(num_kv_heads, -1, width), fmt, dtype)
        width = out.shape[-1]
    return out.view(num_kv_heads, *blocks.shape[:-1], blocks.shape[-1] * block_size, width)


def _step_buffer(
    meta: AttentionMetadata, key: tuple, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """A scratch tensor kept in ``meta.plans`` for the step: every layer reuses it."""
    buf = meta.plans.get(key)
    if buf is None or buf.shape != shape or buf.dtype != like.dtype:
        buf = meta.plans[key] = like.new_empty(shape)
    return buf


def _probe_softmax(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    n, rows = q.shape[:2]
    m, l_sum, o = q.new_empty(n, rows, 1), q.new_empty(n, rows, 1), q.new_empty(n, rows, q.shape[2])
    _tile_softmax(q, k.transpose(1, 2), v, masked, m, l_sum, o)
    return m, l_sum, o


@functools.cache
def exact_tile_rows(head_dim: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The tile row counts of ``ATTN_TILE_LADDER_ROWS`` for which this CPU gives every row the
    bits of the same row in a full ``ATTN_TILE_ROWS`` tile, plus ``ATTN_TILE_ROWS`` itself.

    A GEMM library may pick its kernel by the row count, so this runs the tile softmax itself
    (both products, the mask, the reductions) once per process and shape on random data: full
    tiles against the same rows cut into smaller tiles (a different bmm batch count too), with
    each tile's chunk copied or read in place (a stride-0 batch). Where a size fails, chunks
    that would use it take the next exact size up: slower at decode, equally exact."""
    gen = torch.Generator().manual_seed(0)
    full, keys, batch = ATTN_TILE_ROWS, ATTN_KV_CHUNK, 6
    exact = set(ATTN_TILE_LADDER_ROWS)
    for _ in range(3):
        q = torch.randn(batch, full, head_dim, generator=gen).to(dtype)
        k = torch.randn(batch, keys, head_dim, generator=gen).to(dtype)
        v = torch.randn(batch, keys, head_dim, generator=gen).to(dtype)
        masked = torch.rand(batch, full, keys, generator=gen) < 0.3
        masked[..., 0] = False  # a row always sees its chunk's first key
        for kk, vv in ((k, v), (k[:1].expand(batch, -1, -1), v[:1].expand(batch, -1, -1))):
            reference = _probe_softmax(q, kk, vv, masked)
            for rows in sorted(exact):
                split = (
                    full // rows
                )  # each full tile's first split * rows rows, cut into small tiles
                used = split * rows
                got = _probe_softmax(
                    q[:, :used].reshape(batch * split, rows, head_dim),
                    kk.repeat_interleave(split, 0),
                    vv.repeat_interleave(split, 0),
                    masked[:, :used].reshape(batch * split, rows, keys),
                )
                if not all(
                    torch.equal(a.reshape(batch, used, -1), b[:, :used])
                    for a, b in zip(got, reference, strict=True)
                ):
                    exact.discard(rows)
    chosen = tuple(sorted(exact | {full}))
    log.info(
        "attention tiles: probe on %s found row tiles %s exact (head_dim %d, %s); "
        "reference %d rows",
        cpu_description(),
        list(chosen),
        head_dim,
        str(dtype).removeprefix("torch."),
        full,
    )
    return chosen


def plan_for(
    meta: AttentionMetadata,
    block_size: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> AttentionPlan:
    """The step's ``AttentionPlan``, built on the first layer and reused by the others."""
    key = (block_size, group, num_kv_heads)
    plan = meta.plans.get(key)
    if plan is None:
        plan = build_plan(
            meta.query_start_loc_list,
            meta.seq_lens_list,
            meta.block_tables.tolist(),
            block_size,
            group,
            num_kv_heads,
            ATTN_TILE_ROWS,
            ATTN_KV_CHUNK,
            exact_tile_rows(head_dim, dtype),
        ).to(meta.block_tables.device)
        meta.plans[key] = plan
    return plan


def _tile_softmax(q, k_t, v, masked, m_out, l_out, o_out, num_heads: int = 1) -> None:
    """Tiles ``q [H * n, T, D]`` against their chunks ``k_t [H * n, D, C]``, ``v [H * n, C, D]``
    (H = ``num_heads`` KV heads, head-major); ``masked [num_masked, T, C]`` covers each head's
    first tiles (the others see every key of their chunk).

    ``k_t`` and ``v`` may be one chunk expanded to ``n`` tiles (a stride-0 batch): ``bmm`` then
    multiplies the same fixed ``[T, D] @ [D, C]`` shape per tile without copying the chunk.
    """
    scores = torch.bmm(q, k_t)
    if masked.shape[0]:  # the tiles that need a mask come first
        scores.view(num_heads, -1, *scores.shape[1:])[:, : masked.shape[0]].masked_fill_(
            masked, _MASKED
        )
    torch.amax(scores, dim=-1, keepdim=True, out=m_out)
    p = scores.sub_(m_out).exp_()
    torch.sum(p, dim=-1, keepdim=True, out=l_out)
    torch.bmm(p, v, out=o_out)


def _block_ids(
    meta: AttentionMetadata, key: tuple, blocks: torch.Tensor, num_kv_heads: int, num_blocks: int
) -> torch.Tensor:
    """Rows of the ``[Hkv * num_blocks, block_size * D]`` view of the cache holding ``blocks``
    for every KV head, head-major; kept in ``meta.plans`` for the step's other layers."""
    ids = meta.plans.get(key)
    if ids is None:
        ids = meta.plans[key] = (
            torch.arange(num_kv_heads, device=blocks.device)[:, None] * num_blocks
            + blocks.reshape(1, -1)
        ).reshape(-1)
    return ids


def _attention_tiled(
    query, k_cache, v_cache, meta: AttentionMetadata, scale: float, fmt: KVFormat
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, num_blocks, block_size, width = k_cache.shape
    group = num_heads // num_kv_heads
    plan = plan_for(meta, block_size, group, num_kv_heads, head_dim, query.dtype)
    chunk = plan.kv_chunk

    # Queries as rows [Hkv, R, D]; each tile set copies them tile-major [Hkv, tiles, T, D].
    qh = (query * scale).view(num_tokens, num_kv_heads, group, head_dim).transpose(0, 1)
    qh = qh.reshape(num_kv_heads, num_tokens * group, head_dim)
    # Every cache row is one block of one KV head: a region's keys for all heads are one gather.
    k_rows = k_cache.view(num_kv_heads * num_blocks, block_size * width)
    v_rows = v_cache.view(num_kv_heads * num_blocks, block_size * width)

    # Each tile's softmax over its chunk alone: max m, sum l and unnormalised output o per slot
    # (see kernels/attention_plan.py).
    m = query.new_empty(plan.num_slots)
    l_sum = query.new_empty(plan.num_slots)
    o = query.new_empty(plan.num_slots, head_dim)
    for s, tiles in enumerate(plan.tile_sets):
        tile, num_tiles = tiles.tile_rows, tiles.num_tiles
        q_tiles = qh.index_select(1, tiles.tile_row_ids).view(
            num_kv_heads, num_tiles, tile, head_dim
        )
        for i, region in enumerate(tiles.regions):
            a, b, count = region.first, region.first + region.count, region.count
            slots = slice(region.first_slot, region.first_slot + num_kv_heads * count * tile)
            m_r, l_r, o_r = (
                m[slots].view(-1, tile, 1),
                l_sum[slots].view(-1, tile, 1),
                o[slots].view(-1, tile, head_dim),
            )
            ids_key = ("ids", block_size, group, num_kv_heads, num_blocks, s, i)
            ids = _block_ids(meta, ids_key, region.blocks, num_kv_heads, num_blocks)
            shape = (ids.numel(), block_size * width)
            k = torch.index_select(
                k_rows, 0, ids, out=_step_buffer(meta, ("k", s, i), shape, k_cache)
            )
            v = torch.index_select(
                v_rows, 0, ids, out=_step_buffer(meta, ("v", s, i), shape, v_cache)
            )
            if fmt.quantized:  # read the rows back into the query's dtype
                k, v = (
                    _read_back(meta, (name, s, i), raw, fmt, block_size, query)
                    for name, raw in (("kq", k), ("vq", v))
                )
            masked = tiles.tile_masked[a : a + region.num_masked]
            if (
                region.shared
            ):  # every tile reads the one chunk in place (a stride-0 batch), per head
                k, v = (
                    k.view(num_kv_heads, 1, chunk, head_dim),
                    v.view(num_kv_heads, 1, chunk, head_dim),
                )
                for h in range(num_kv_heads):
                    heads = slice(h * count, (h + 1) * count)
                    _tile_softmax(
                        q_tiles[h, a:b],
                        k[h].expand(count, -1, -1).transpose(1, 2),
                        v[h].expand(count, -1, -1),
                        masked,
                        m_r[heads],
                        l_r[heads],
                        o_r[heads],
                    )
            else:  # one batch over every KV head's tiles, each with its own copy of its chunk
                k = k.view(num_kv_heads * count, chunk, head_dim)
                v = v.view(num_kv_heads * count, chunk, head_dim)
                q = q_tiles[:, a:b].reshape(num_kv_heads * count, tile, head_dim)
                _tile_softmax(q, k.transpose(1, 2), v, masked, m_r, l_r, o_r, num_kv_heads)

    # Fold each row's chunks in ascending order: elementwise, so per row and batch-invariant.
    # Rows are in the plan's fold order, so the rows meeting chunk index c are a prefix.
    index = plan.merge_index.reshape(-1)
    all_m = m.index_select(0, index).view(num_kv_heads, -1, 1)
    all_l = l_sum.index_select(0, index).view(num_kv_heads, -1, 1)
    all_o = o.index_select(0, index).view(num_kv_heads, -1, head_dim)
    rows = plan.num_rows
    run_m, run_l, run_o = all_m[:, :rows], all_l[:, :rows], all_o[:, :rows]  # chunk 0: every row
    start = rows
    for count in plan.merge_counts[1:]:
        new = slice(start, start + count)
        old_m = run_m[:, :count]
        both_m = torch.maximum(old_m, all_m[:, new])
        a, b = torch.exp(old_m - both_m), torch.exp(all_m[:, new] - both_m)
        torch.add(run_l[:, :count] * a, all_l[:, new] * b, out=run_l[:, :count])
        torch.add(run_o[:, :count] * a, all_o[:, new] * b, out=run_o[:, :count])
        old_m.copy_(both_m)
        start += count
    out = (run_o / run_l).index_select(1, plan.merge_rank)
    out = out.view(num_kv_heads, num_tokens, group, head_dim).transpose(0, 1)
    return out.reshape(num_tokens, num_heads, head_dim)


def _read_back(
    meta: AttentionMetadata,
    key: tuple,
    raw: torch.Tensor,
    fmt: KVFormat,
    block_size: int,
    query: torch.Tensor,
) -> torch.Tensor:
    """Gathered 8-bit rows ([blocks, block_size * (D + 2)] bytes) as [blocks, block_size * D]
    of the query's dtype, in a step buffer every layer reuses."""
    num_rows, head_dim = raw.shape[0], query.shape[-1]
    out = _step_buffer(meta, key, (num_rows, block_size * head_dim), query)
    dequantize_rows(
        raw.view(num_rows, block_size, head_dim + 2),
        fmt,
        query.dtype,
        out=out.view(num_rows, block_size, head_dim),
    )
    return out


def _attention_fast(
    query, k_cache, v_cache, meta: AttentionMetadata, scale: float, fmt: KVFormat
) -> torch.Tensor:
    block_size = k_cache.shape[2]
    qsl, lens = meta.query_start_loc_list, meta.seq_lens_list
    out = torch.empty_like(query)
    decodes = [s for s in range(len(lens)) if qsl[s + 1] - qsl[s] == 1]
    for s in range(len(lens)):
        q_len = qsl[s + 1] - qsl[s]
        if q_len == 1:
            continue
        nb = -(-lens[s] // block_size)
        blocks = meta.block_tables[s, :nb].long()
        k = _gather_kv(k_cache, blocks, fmt=fmt, dtype=query.dtype)[:, : lens[s]]  # [Hkv, L, D]
        v = _gather_kv(v_cache, blocks, fmt=fmt, dtype=query.dtype)[:, : lens[s]]
        q_pos = torch.arange(lens[s] - q_len, lens[s], device=query.device)
        mask = torch.arange(lens[s], device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            query[qsl[s] : qsl[s + 1]].transpose(0, 1),
            k,
            v,
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[qsl[s] : qsl[s + 1]] = o.transpose(0, 1)
    if decodes:
        # Decodes share prefix chunks: the tiled path reads each shared chunk once.
        cached = meta.plans.get("decodes")
        if cached is None:  # once per step; every layer reuses it
            sub = AttentionMetadata(
                query_start_loc=torch.arange(
                    len(decodes) + 1, dtype=torch.int32, device=query.device
                ),
                seq_lens=meta.seq_lens[decodes],
                block_tables=meta.block_tables[decodes],
                slot_mapping=meta.slot_mapping[:0],
                query_start_loc_list=list(range(len(decodes) + 1)),
                seq_lens_list=[lens[s] for s in decodes],
            )
            rows = torch.tensor([qsl[s] for s in decodes], device=query.device)
            cached = meta.plans["decodes"] = (sub, rows)
        sub, rows = cached
        out[rows] = _attention_tiled(query[rows], k_cache, v_cache, sub, scale, fmt)
    return out
