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
    ``[ATTN_TILE_ROWS, ATTN_KV_CHUNK] @ [ATTN_KV_CHUNK, head_dim]`` for values.
    A *row* is one (query token, query head) pair of one sequence and one KV head; rows are
    packed into tiles of ``ATTN_TILE_ROWS``. The KV sequence is reduced with an online softmax
    in chunks of ``ATTN_KV_CHUNK`` keys aligned to position 0, always in ascending order. Keys
    a row may not see are masked to probability exactly 0, and a chunk a row cannot see at all
    leaves its running max, sum and accumulator bitwise unchanged (``x * 1.0 + 0.0 == x``).
    So a query's output is the same whether it is computed in a fresh prefill, after a cache
    hit, in any chunk of a chunked prefill, or as a decode, and whatever shares the batch.

Fast path (``deterministic=False``)
    One ``scaled_dot_product_attention`` call per prefill sequence and one padded call for all
    decodes. Faster, but its rounding depends on the batch; kept to measure the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_TILE_ROWS = 16
"""Rows per score tile: small enough that a decode (``group`` rows) wastes little."""
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


def _gather_kv(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Head-major cache, [..., nblocks] block ids -> [Hkv, ..., nblocks * block_size, D].

    ``index_select`` on a 3-D view copies whole blocks at memory speed; advanced indexing
    was measured 4x slower.
    """
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    flat = cache.view(num_kv_heads, num_blocks, block_size * head_dim).index_select(1, blocks.reshape(-1))
    return flat.view(num_kv_heads, *blocks.shape[:-1], blocks.shape[-1] * block_size, head_dim)


def _attention_tiled(query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    tile, chunk = ATTN_TILE_ROWS, ATTN_KV_CHUNK
    blocks_per_chunk = chunk // block_size
    qsl, lens = meta.query_start_loc_list, meta.seq_lens_list

    # Work items: (sequence, tile of rows). Row r of a sequence is token r // group, head r % group.
    item_seq, item_row0 = [], []
    for s in range(len(lens)):
        rows = (qsl[s + 1] - qsl[s]) * group
        for r0 in range(0, rows, tile):
            item_seq.append(s)
            item_row0.append(r0)
    num_items = len(item_seq)
    seq_idx = torch.tensor(item_seq, dtype=torch.long)
    row = torch.tensor(item_row0, dtype=torch.long)[:, None] + torch.arange(tile)[None, :]  # [I, T]
    q_start = torch.tensor(qsl[:-1], dtype=torch.long)[seq_idx]
    q_len = torch.tensor(qsl[1:], dtype=torch.long)[seq_idx] - q_start
    ctx = torch.tensor(lens, dtype=torch.long)[seq_idx]
    valid = row < (q_len * group)[:, None]
    token = q_start[:, None] + row // group
    pos = torch.where(valid, (ctx - q_len)[:, None] + row // group, torch.full_like(row, -1))

    # Queries as [Hkv, N * group, D]; gather each item's rows -> [Hkv * I, T, D].
    qh = query.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    qh = qh.reshape(num_kv_heads, num_tokens * group, head_dim)
    flat = torch.where(valid, token * group + row % group, torch.zeros_like(row))
    q_items = qh[:, flat.reshape(-1)].reshape(num_kv_heads * num_items, tile, head_dim) * scale

    acc = query.new_zeros(num_kv_heads * num_items, tile, head_dim)
    m = query.new_full((num_kv_heads * num_items, tile, 1), _MASKED)
    denom = query.new_zeros(num_kv_heads * num_items, tile, 1)
    max_pos = int(pos.max()) if num_items else -1
    tables = meta.block_tables.long()  # [S, max_blocks]
    one_item_per_seq = num_items == len(lens)  # decodes: skip the per-item copy
    pos_b = pos.repeat(num_kv_heads, 1)[:, :, None]  # [Hkv * I, T, 1]
    for c in range(max_pos // chunk + 1):
        b0 = c * blocks_per_chunk
        blocks = tables[:, b0 : b0 + blocks_per_chunk]
        if blocks.shape[1] < blocks_per_chunk:  # table shorter than a chunk: pad with block 0
            blocks = F.pad(blocks, (0, blocks_per_chunk - blocks.shape[1]))
        # One gather per sequence, [Hkv, S, C, D], then one copy per item when a sequence
        # has several tiles.
        k = _gather_kv(k_cache, blocks)
        v = _gather_kv(v_cache, blocks)
        if not one_item_per_seq:
            k, v = k[:, seq_idx], v[:, seq_idx]
        k = k.reshape(-1, chunk, head_dim)
        v = v.reshape(-1, chunk, head_dim)
        scores = torch.bmm(q_items, k.transpose(1, 2))  # [Hkv * I, T, C]
        key_pos = torch.arange(c * chunk, (c + 1) * chunk)
        scores.masked_fill_(key_pos[None, None, :] > pos_b, _MASKED)
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        p = torch.exp(scores - m_new)
        alpha = torch.exp(m - m_new)
        denom = denom * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, v)
        m = m_new
    out_items = (acc / denom).reshape(num_kv_heads, num_items * tile, head_dim)

    out = query.new_empty(num_kv_heads, num_tokens * group, head_dim)
    keep = valid.reshape(-1)
    out[:, flat.reshape(-1)[keep]] = out_items[:, keep]
    out = out.view(num_kv_heads, num_tokens, group, head_dim).permute(1, 0, 2, 3)
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
        idx = torch.tensor(decodes)
        max_len = max(lens[s] for s in decodes)
        nb = -(-max_len // block_size)
        tables = meta.block_tables[idx, :nb].long()
        k = _gather_kv(k_cache, tables)[:, :, :max_len].transpose(0, 1)  # [B, Hkv, L, D]
        v = _gather_kv(v_cache, tables)[:, :, :max_len].transpose(0, 1)
        lens_t = torch.tensor([lens[s] for s in decodes])
        mask = (torch.arange(max_len)[None, :] < lens_t[:, None])[:, None, None, :]
        rows = torch.tensor([qsl[s] for s in decodes])
        o = F.scaled_dot_product_attention(
            query[rows][:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[rows] = o[:, :, 0, :]
    return out
