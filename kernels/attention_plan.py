"""The per-step work plan of the CPU paged attention: which query rows meet which KV chunks.

A *row* is one (query token, query head of a KV group) pair: token ``t`` of the flat batch
and head ``g`` of its group are row ``t * group + g``, for every KV head alike. The keys of
a sequence are cut into *chunks* of ``kv_chunk`` positions aligned to position 0. A chunk is
identified by its index and the block ids that hold it, so two sequences that share cached
blocks (a system prompt, a chat history, the ``n > 1`` siblings of one prompt) share the
chunk, and its keys are read once for all of their rows.

Rows meeting one chunk are packed into *tiles*. Every tile is one fixed-shape matmul, so a
row's result never depends on which other rows share its tile or the batch (see
``kernels/attention.py``). The reference tile has ``tile_rows`` rows; the caller passes the
smaller row counts it has proven to give a row the same bits (``exact_tile_rows``). A chunk
met by at most ``tile_rows`` rows gets one tile of the smallest proven size that holds them
(a decode's own last chunk: one token's ``group`` heads); a chunk met by more gets full tiles
and, for the rest, one tile of the smallest proven size that holds the rest. Tiles of one row
count form a *tile set*.

A row meets chunks ``0 .. pos // kv_chunk``, always in that order. The tiles write their
partial softmax results (max, sum, unnormalised output) to *slots*, one per tile row and KV
head, numbered region by region and, inside a region, head-major (so a region's tiles for
every KV head are one contiguous batch). The fold then walks chunk indices in ascending
order over the rows sorted by how many chunks they meet (most first), so the rows that meet
chunk ``c`` are always a prefix, ``merge_counts[c]`` long: ``merge_index[h]`` lists, chunk
index by chunk index, the slot of each such row's partial result under KV head ``h``.

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

from dataclasses import dataclass, replace

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
    first_slot: int
    """The region's first slot: its ``num_kv_heads * count * tile_rows`` slots follow, for KV
    head 0's tiles first."""

    @property
    def shared(self) -> bool:
        return self.blocks.dim() == 1

    def to(self, device: torch.device) -> TileRegion:
        return replace(self, blocks=self.blocks.to(device))


@dataclass
class TileSet:
    """Tiles of one row count, laid out in regions."""

    tile_rows: int
    tile_row_ids: torch.Tensor
    """[num_tiles * tile_rows] row of each tile position (0 for padding)."""
    tile_masked: torch.Tensor
    """[num_tiles, tile_rows, kv_chunk] bool: True where a tile position may not see a key."""
    regions: list[TileRegion]

    @property
    def num_tiles(self) -> int:
        return self.tile_masked.shape[0]

    def to(self, device: torch.device) -> TileSet:
        return replace(
            self,
            tile_row_ids=self.tile_row_ids.to(device),
            tile_masked=self.tile_masked.to(device),
            regions=[region.to(device) for region in self.regions],
        )


@dataclass
class AttentionPlan:
    kv_chunk: int
    num_rows: int
    """Rows of the batch: ``num_tokens * group``."""
    num_kv_heads: int
    tile_sets: list[TileSet]
    num_slots: int
    """Slots of every tile set and KV head together."""
    merge_rank: torch.Tensor
    """[num_rows] position of each row in the fold's order (rows meeting more chunks first)."""
    merge_counts: list[int]
    """Per chunk index ``c``: how many rows meet a chunk at index c (a prefix of the order)."""
    merge_index: torch.Tensor
    """[num_kv_heads, sum(merge_counts)] slot of each (chunk index, row of that prefix) pair's
    partial result, chunk index by chunk index."""

    def to(self, device: torch.device) -> AttentionPlan:
        """The plan with its index tensors on ``device`` (it is built on the CPU, in Python)."""
        if self.merge_index.device == torch.device(device):
            return self
        return replace(
            self,
            tile_sets=[tiles.to(device) for tiles in self.tile_sets],
            merge_rank=self.merge_rank.to(device),
            merge_index=self.merge_index.to(device),
        )


@dataclass
class _ChunkTiles:
    """Some of one chunk's rows packed into tiles of one size, before they get a region."""

    index: int
    blocks: list[int]
    rows: torch.Tensor
    """[count, T] row per tile position, -1 for padding."""
    pos: torch.Tensor
    """[count, T] position per tile position, -1 for padding."""
    needs_mask: torch.Tensor
    """[count] bool: some real row of the tile cannot see the chunk's last key."""


def _tiles_for(num_rows: int, tile_rows: int, exact: tuple[int, ...]) -> list[tuple[int, int]]:
    """(rows, tile size) pieces: full tiles for the bulk, the smallest proven tile for the rest."""
    full = (num_rows // tile_rows) * tile_rows if num_rows > tile_rows else 0
    pieces = [(full, tile_rows)] if full else []
    rest = num_rows - full
    if rest:
        pieces.append((rest, min(t for t in exact if t >= rest)))
    return pieces


def _collect_chunks(
    query_start_loc, seq_lens, block_tables, block_size, group, kv_chunk, tile_rows, exact
):
    """Every chunk some row meets, its rows packed in tiles."""
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
            key = (
                c,
                tuple(table[c * blocks_per_chunk : min((c + 1) * blocks_per_chunk, num_blocks)]),
            )
            segments_by_chunk.setdefault(key, []).append((t0 * group, q1 * group, first_pos - q0))
    chunks = []
    for (c, blocks), segments in segments_by_chunk.items():
        all_rows = torch.cat([torch.arange(a, b) for a, b, _ in segments])
        all_pos = torch.cat([torch.arange(a, b) // group + offset for a, b, offset in segments])
        padded_blocks = list(blocks) + [0] * (blocks_per_chunk - len(blocks))
        start = 0
        for count, size in _tiles_for(all_rows.numel(), tile_rows, exact):
            rows, pos = all_rows[start : start + count], all_pos[start : start + count]
            start += count
            pad = (-count) % size
            rows = torch.cat([rows, rows.new_full((pad,), -1)]).view(-1, size)
            pos = torch.cat([pos, pos.new_full((pad,), -1)]).view(-1, size)
            lowest = torch.where(rows >= 0, pos, torch.iinfo(pos.dtype).max).amin(dim=1)
            chunks.append(_ChunkTiles(c, padded_blocks, rows, pos, lowest < (c + 1) * kv_chunk - 1))
    return chunks


def _tile_set(
    chunks: list[_ChunkTiles],
    tile_rows: int,
    kv_chunk: int,
    num_kv_heads: int,
    first_slot: int,
    merge_entries: list[tuple[torch.Tensor, ...]],
) -> tuple[TileSet, int]:
    """Lays ``chunks`` (all tiled by ``tile_rows``) out in regions from slot ``first_slot`` on;
    appends their rows' merge entries (chunk index, row, slot of head 0, slots per head).
    Returns the tile set and the next free slot."""
    light = [ch for ch in chunks if ch.rows.shape[0] < SHARED_CHUNK_MIN_TILES]
    heavy = [ch for ch in chunks if ch.rows.shape[0] >= SHARED_CHUNK_MIN_TILES]
    # Lay out regions: tile arrays in final order, masked tiles first within each region.
    groups = ([(light, False)] if light else []) + [([ch], True) for ch in heavy]
    regions, rows_out, pos_out, first_key = [], [], [], []
    num_tiles = 0
    for members, shared in groups:
        rows = torch.cat([ch.rows for ch in members])
        pos = torch.cat([ch.pos for ch in members])
        index = torch.cat([torch.full((ch.rows.shape[0],), ch.index) for ch in members])
        needs = torch.cat([ch.needs_mask for ch in members])
        order = torch.argsort(needs.to(torch.int8), descending=True, stable=True)
        rows, pos, index = rows[order], pos[order], index[order]
        count = rows.shape[0]
        if shared:
            blocks = torch.tensor(members[0].blocks, dtype=torch.long)
        else:
            chunk_blocks = torch.cat(
                [
                    torch.tensor([ch.blocks], dtype=torch.long).expand(ch.rows.shape[0], -1)
                    for ch in members
                ]
            )
            blocks = chunk_blocks[order]
        regions.append(TileRegion(num_tiles, count, int(needs.sum()), blocks, first_slot))
        per_head = count * tile_rows
        slots = first_slot + torch.arange(per_head)
        real = rows.flatten() >= 0
        merge_entries.append(
            (
                index[:, None].expand(-1, tile_rows).flatten()[real],
                rows.flatten()[real],
                slots[real],
                torch.full((int(real.sum()),), per_head),
            )
        )
        rows_out.append(rows.clamp(min=0))
        pos_out.append(pos)
        first_key.append(index * kv_chunk)
        num_tiles += count
        first_slot += num_kv_heads * per_head
    tile_pos = torch.cat(pos_out)
    key_pos = torch.cat(first_key)[:, None, None] + torch.arange(kv_chunk)[None, None, :]
    return TileSet(
        tile_rows, torch.cat(rows_out).flatten(), key_pos > tile_pos[:, :, None], regions
    ), first_slot


def build_plan(
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    group: int,
    num_kv_heads: int,
    tile_rows: int,
    kv_chunk: int,
    exact_tile_rows: tuple[int, ...] = (),
) -> AttentionPlan:
    """Groups every sequence's rows by the chunks they meet; see the module docstring.
    ``exact_tile_rows``: tile row counts below ``tile_rows`` proven to round like it."""
    exact = tuple(sorted({t for t in exact_tile_rows if t < tile_rows} | {tile_rows}))
    chunks = _collect_chunks(
        query_start_loc, seq_lens, block_tables, block_size, group, kv_chunk, tile_rows, exact
    )
    merge_entries: list[
        tuple[torch.Tensor, ...]
    ] = []  # (chunk index, row, head-0 slot, slots per head)
    tile_sets: list[TileSet] = []
    num_slots = 0
    for size in sorted({ch.rows.shape[1] for ch in chunks}, reverse=True):
        members = [ch for ch in chunks if ch.rows.shape[1] == size]
        tiles, num_slots = _tile_set(
            members, size, kv_chunk, num_kv_heads, num_slots, merge_entries
        )
        tile_sets.append(tiles)

    # Fold order: rows meeting more chunks first, so the rows of chunk index c are a prefix.
    num_rows = query_start_loc[-1] * group
    if merge_entries:
        entry_chunk, entry_row, entry_slot, entry_stride = (
            torch.cat(parts) for parts in zip(*merge_entries, strict=True)
        )
    else:
        entry_chunk = entry_row = entry_slot = entry_stride = torch.zeros(0, dtype=torch.long)
    chunks_of_row = torch.zeros(num_rows, dtype=torch.long).scatter_reduce_(
        0, entry_row, entry_chunk + 1, "amax"
    )
    order = torch.argsort(chunks_of_row, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_rows)
    counts = torch.bincount(entry_chunk, minlength=int(chunks_of_row.max()) if num_rows else 0)
    offsets = torch.cumsum(counts, 0) - counts
    heads = torch.arange(num_kv_heads)[:, None]
    merge_index = torch.empty(num_kv_heads, int(counts.sum()), dtype=torch.long)
    merge_index[:, offsets[entry_chunk] + rank[entry_row]] = (
        entry_slot[None] + heads * entry_stride[None]
    )
    return AttentionPlan(
        kv_chunk, num_rows, num_kv_heads, tile_sets, num_slots, rank, counts.tolist(), merge_index
    )
