"""The per-step work plan of the CPU paged attention: which query rows meet which KV chunks.

A *row* is one (query token, query head of a KV group) pair: token ``t`` of the flat batch
and head ``g`` of its group are row ``t * group + g``, for every KV head alike. The keys of
a sequence are cut into *chunks* of ``kv_chunk`` positions aligned to position 0. A chunk is
identified by its index and the block ids that hold it, so two sequences that share cached
blocks (a system prompt, a chat history, the ``n > 1`` siblings of one prompt) share the
chunk, and its keys are read once for all of their rows.

Rows meeting one chunk are packed into *tiles* of ``tile_rows`` rows (the last one padded).
Every tile is one fixed-shape matmul, so a row's result never depends on which other rows
share its tile or the batch (see ``kernels/attention.py``). A chunk met by at most
``small_tile_rows`` rows (a decode's own last chunk: one token's ``group`` heads) gets one
small tile instead, when the caller has checked that this CPU's matmul gives a row the same
bits in a small tile as in a full one (``kernels/attention.py``'s ``small_tiles_are_exact``):
a full tile would be mostly padding. Small and full tiles form two *tile sets*.

A row meets chunks ``0 .. pos // kv_chunk``, always in that order; ``merge_rows``/``merge_src``
say, for chunk index ``c``, which rows fold in which tile slot's partial result (the slots of
all tile sets are numbered one after the other).

Tiles are laid out in *regions* computed together: first every tile of lightly shared chunks
(their keys gathered into one batched copy, one tile per copy), then one region per heavily
shared chunk (a long prefill, or a prompt shared by many decodes), whose tiles all read the
chunk in place. Inside a region, tiles that need a causal mask come first, so the kernel
masks a prefix of the region and leaves fully visible tiles alone.

The plan depends only on the step's metadata, not on the layer, so it is built once per
step and reused by every layer (``plan_for``). Building it costs Python time proportional
to the number of (sequence, chunk) pairs, not to the number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHARED_CHUNK_MIN_TILES = 8
"""A chunk met by at least this many tiles gets its own region, read in place (one matmul
call per KV head) instead of copied once per tile."""


@dataclass(frozen=True)
class TileRegion:
    first: int
    """First tile of the region, within its tile set."""
    count: int
    num_masked: int
    """Tiles ``first .. first + num_masked - 1`` need the causal mask; the rest see every key."""
    blocks: torch.Tensor
    """[count, blocks_per_chunk] block ids of each tile's chunk (gathered region), or
    [blocks_per_chunk] of the one chunk every tile reads (shared region). Padded with 0."""

    @property
    def shared(self) -> bool:
        return self.blocks.dim() == 1


@dataclass
class TileSet:
    """Tiles of one row count, laid out in regions."""

    tile_rows: int
    first_slot: int
    """Slot number of this set's first slot in the step's slot numbering."""
    tile_row_ids: torch.Tensor
    """[num_tiles * tile_rows] row of each tile slot (0 for padding slots)."""
    tile_masked: torch.Tensor
    """[num_tiles, tile_rows, kv_chunk] bool: True where a slot may not see a key."""
    regions: list[TileRegion]

    @property
    def num_tiles(self) -> int:
        return self.tile_masked.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_tiles * self.tile_rows


@dataclass
class AttentionPlan:
    kv_chunk: int
    num_rows: int
    """Rows of the batch: ``num_tokens * group``."""
    tile_sets: list[TileSet]
    merge_rows: list[torch.Tensor | None]
    """Per chunk index ``c``: rows that meet a chunk at index c (None: every row)."""
    merge_src: list[torch.Tensor]
    """Per chunk index ``c``: the slot (``first_slot + tile * tile_rows + slot``) of each such row."""

    @property
    def num_slots(self) -> int:
        return sum(ts.num_slots for ts in self.tile_sets)


@dataclass
class _ChunkTiles:
    """One chunk's rows packed into tiles, before the tiles are placed in a region."""

    index: int
    blocks: list[int]
    rows: torch.Tensor
    """[count, T] row per slot, -1 for padding."""
    pos: torch.Tensor
    """[count, T] position per slot, -1 for padding."""
    needs_mask: torch.Tensor
    """[count] bool: some real row of the tile cannot see the chunk's last key."""


def _collect_chunks(query_start_loc, seq_lens, block_tables, block_size, group, kv_chunk, tile_rows_of):
    """Every chunk some row meets, its rows packed in tiles of ``tile_rows_of(num_rows)``."""
    blocks_per_chunk = kv_chunk // block_size
    # chunk key (index, block ids) -> segments (first row, end row, position of row r - r // group)
    segments_by_chunk: dict[tuple, list[tuple[int, int, int]]] = {}
    for s, ctx in enumerate(seq_lens):
        q0, q1 = query_start_loc[s], query_start_loc[s + 1]
        first_pos = ctx - (q1 - q0)
        num_blocks = -(-ctx // block_size)
        table = block_tables[s]
        for c in range(-(-ctx // kv_chunk)):
            # Tokens at positions >= c * kv_chunk see at least one key of chunk c.
            t0 = q0 + max(0, c * kv_chunk - first_pos)
            key = (c, tuple(table[c * blocks_per_chunk : min((c + 1) * blocks_per_chunk, num_blocks)]))
            segments_by_chunk.setdefault(key, []).append((t0 * group, q1 * group, first_pos - q0))
    chunks = []
    for (c, blocks), segments in segments_by_chunk.items():
        rows = torch.cat([torch.arange(a, b) for a, b, _ in segments])
        pos = torch.cat([torch.arange(a, b) // group + offset for a, b, offset in segments])
        tile_rows = tile_rows_of(rows.numel())
        pad = (-rows.numel()) % tile_rows
        rows = torch.cat([rows, rows.new_full((pad,), -1)]).view(-1, tile_rows)
        pos = torch.cat([pos, pos.new_full((pad,), -1)]).view(-1, tile_rows)
        lowest = torch.where(rows >= 0, pos, torch.iinfo(pos.dtype).max).amin(dim=1)
        chunks.append(_ChunkTiles(c, list(blocks) + [0] * (blocks_per_chunk - len(blocks)), rows, pos,
                                  lowest < (c + 1) * kv_chunk - 1))
    return chunks


def _tile_set(chunks: list[_ChunkTiles], tile_rows: int, kv_chunk: int, first_slot: int,
              merge_entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> TileSet:
    """Lays ``chunks`` (all tiled by ``tile_rows``) out in regions; appends their rows' merge
    entries (chunk index, row, slot)."""
    light = [ch for ch in chunks if ch.rows.shape[0] < SHARED_CHUNK_MIN_TILES]
    heavy = [ch for ch in chunks if ch.rows.shape[0] >= SHARED_CHUNK_MIN_TILES]
    # Lay out regions: tile arrays in final order, masked tiles first within each region.
    groups = ([light] if light else []) + [[ch] for ch in heavy]
    regions, rows_out, pos_out, first_key = [], [], [], []
    num_tiles = 0
    for members in groups:
        rows = torch.cat([ch.rows for ch in members])
        pos = torch.cat([ch.pos for ch in members])
        index = torch.cat([torch.full((ch.rows.shape[0],), ch.index) for ch in members])
        needs = torch.cat([ch.needs_mask for ch in members])
        order = torch.argsort(needs.to(torch.int8), descending=True, stable=True)
        rows, pos, index = rows[order], pos[order], index[order]
        count = rows.shape[0]
        if len(members) == 1 and members[0] in heavy:
            blocks = torch.tensor(members[0].blocks, dtype=torch.long)
        else:
            chunk_blocks = torch.cat([torch.tensor([ch.blocks], dtype=torch.long).expand(ch.rows.shape[0], -1)
                                      for ch in members])
            blocks = chunk_blocks[order]
        regions.append(TileRegion(num_tiles, count, int(needs.sum()), blocks))
        slots = first_slot + num_tiles * tile_rows + torch.arange(count * tile_rows)
        real = rows.flatten() >= 0
        merge_entries.append((index[:, None].expand(-1, tile_rows).flatten()[real], rows.flatten()[real], slots[real]))
        rows_out.append(rows.clamp(min=0))
        pos_out.append(pos)
        first_key.append(index * kv_chunk)
        num_tiles += count
    tile_pos = torch.cat(pos_out)
    key_pos = torch.cat(first_key)[:, None, None] + torch.arange(kv_chunk)[None, None, :]
    return TileSet(tile_rows, first_slot, torch.cat(rows_out).flatten(), key_pos > tile_pos[:, :, None], regions)


def build_plan(
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    group: int,
    tile_rows: int,
    kv_chunk: int,
    small_tile_rows: int | None = None,
) -> AttentionPlan:
    """Groups every sequence's rows by the chunks they meet; see the module docstring.
    ``small_tile_rows``: tile size for chunks met by that many rows or fewer (None: none)."""

    def tile_rows_of(num_rows: int) -> int:
        return small_tile_rows if small_tile_rows is not None and num_rows <= small_tile_rows else tile_rows

    chunks = _collect_chunks(query_start_loc, seq_lens, block_tables, block_size, group, kv_chunk, tile_rows_of)
    merge_entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (chunk index, row, slot)
    tile_sets: list[TileSet] = []
    for size in sorted({ch.rows.shape[1] for ch in chunks}, reverse=True):
        first_slot = sum(ts.num_slots for ts in tile_sets)
        members = [ch for ch in chunks if ch.rows.shape[1] == size]
        tile_sets.append(_tile_set(members, size, kv_chunk, first_slot, merge_entries))

    # Merge schedule, by chunk index. Every row meets chunk 0, and each chunk index once.
    num_rows = query_start_loc[-1] * group
    entry_chunk = torch.cat([e[0] for e in merge_entries]) if merge_entries else torch.zeros(0, dtype=torch.long)
    entry_row = torch.cat([e[1] for e in merge_entries]) if merge_entries else entry_chunk
    entry_slot = torch.cat([e[2] for e in merge_entries]) if merge_entries else entry_chunk
    # Sort by (chunk index, row): row ids are < num_rows, so one key orders both.
    order = torch.argsort(entry_chunk * num_rows + entry_row)
    entry_chunk, entry_row, entry_slot = entry_chunk[order], entry_row[order], entry_slot[order]
    counts = torch.bincount(entry_chunk).tolist() if entry_chunk.numel() else []
    merge_rows: list[torch.Tensor | None] = []
    merge_src: list[torch.Tensor] = []
    for rows, src in zip(entry_row.split(counts), entry_slot.split(counts), strict=True):
        merge_rows.append(None if rows.numel() == num_rows else rows)
        merge_src.append(src)
    return AttentionPlan(kv_chunk, num_rows, tile_sets, merge_rows, merge_src)
