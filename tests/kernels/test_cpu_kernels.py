"""The torch CPU kernels against their reference twins, and their batch invariance.

Every case draws fresh random inputs. Batch invariance is checked bitwise: a row computed
alone equals the same row computed among others, and a query's attention output is the same
whether it is computed in one prefill, split across prefill chunks, or as a decode.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from kernels.attention import AttentionMetadata, paged_attention
from kernels.cache import store_kv
from kernels.linear import (
    FAST_PLAIN_MIN_ROWS,
    PackedWeight,
    batch_invariant_linear,
    fast_linear,
    pack_weight,
)
from kernels.norm import rms_norm
from kernels.reference import (
    matmul_ref,
    paged_attention_ref,
    rms_norm_ref,
    rotary_ref,
    store_kv_ref,
)
from kernels.rotary import apply_rotary, build_cos_sin_cache


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The reference's block-major cache in the CPU path's head-major layout."""
    return cache.permute(2, 0, 1, 3).contiguous()


def make_meta(seqs: list[tuple[int, int]], block_size: int, num_blocks: int):
    """seqs: (context length incl. new tokens, new query tokens). Random distinct block ids."""
    ids = list(range(num_blocks))
    random.shuffle(ids)
    tables, qsl, slots = [], [0], []
    for ctx, q in seqs:
        nb = -(-ctx // block_size)
        table = [ids.pop() for _ in range(nb)]
        tables.append(table)
        qsl.append(qsl[-1] + q)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q, ctx)]
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    lens = [c for c, _ in seqs]
    return AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(slots, dtype=torch.long),
        qsl,
        lens,
    )


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_matches_reference(group, deterministic, block_size):
    num_kv, head_dim = 2, 64
    seqs = [(1, 1), (17, 17), (300, 1), (33, 16), (16, 16), (129, 40)]
    meta = make_meta(seqs, block_size, 64)
    shape = (64, block_size, num_kv, head_dim)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    q = torch.randn(meta.query_start_loc_list[-1], num_kv * group, head_dim)
    out = paged_attention(
        q, head_major(k_cache), head_major(v_cache), meta, head_dim**-0.5, deterministic
    )
    ref = paged_attention_ref(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, head_dim**-0.5
    )
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_attention_is_batch_and_chunk_invariant():
    num_kv, group, head_dim, bs = 3, 3, 64, 16
    shape = (num_kv, 96, bs, head_dim)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    ctx = random.randint(150, 400)
    meta_full = make_meta([(ctx, ctx)], bs, 96)
    q = torch.randn(ctx, num_kv * group, head_dim)
    full = paged_attention(q, k_cache, v_cache, meta_full, 0.125, True)
    table = meta_full.block_tables

    def one(ctx_len, q_rows):
        meta = AttentionMetadata(
            torch.tensor([0, len(q_rows)], dtype=torch.int32),
            torch.tensor([ctx_len], dtype=torch.int32),
            table,
            torch.zeros(0, dtype=torch.long),
            [0, len(q_rows)],
            [ctx_len],
        )
        return paged_attention(q[q_rows], k_cache, v_cache, meta, 0.125, True)

    # Decode of the last token, prefill chunks of 1..129 tokens (their chunks' rows fill tiles of
    # every size the probe admits), and the same among other sequences.
    assert torch.equal(one(ctx, [ctx - 1])[0], full[ctx - 1])
    for m in (1, 2, 3, 5, 6, 8, 11, 16, 17, 33, 37, 64, 100, 129):
        start = random.randrange(0, ctx - m + 1)
        mid = list(range(start, start + m))
        assert torch.equal(one(start + m, mid), full[mid]), (start, m)
    others = make_meta([(ctx, ctx), (90, 5), (7, 7)], bs, 96)
    others.block_tables[0, : table.shape[1]] = table[0]
    q_batch = torch.cat([q, torch.randn(12, num_kv * group, head_dim)])
    batched = paged_attention(q_batch, k_cache, v_cache, others, 0.125, True)
    assert torch.equal(batched[:ctx], full)


def _shared_prefix_batch(num_decodes: int, bs: int, prefix_blocks: int):
    """Decodes (and one prefill) whose tables start with the same prefix blocks."""
    prefix = list(range(1, prefix_blocks + 1))
    next_block = prefix_blocks + 1
    tables, qsl, lens = [], [0], []
    for i in range(num_decodes + 1):
        own = random.randint(1, 3)
        tables.append(prefix + list(range(next_block, next_block + own)))
        next_block += own
        ctx = (prefix_blocks + own - 1) * bs + random.randint(1, bs)
        q = 100 if i == num_decodes else 1  # the last one prefills its tail
        qsl.append(qsl[-1] + q)
        lens.append(ctx)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(padded, dtype=torch.int32),
        torch.zeros(0, dtype=torch.long),
        qsl,
        lens,
    )
    return meta, next_block


def test_attention_over_shared_prefix_matches_reference_and_is_invariant():
    """Chunks shared by many sequences are read once (kernels/attention_plan.py); a decode's
    output must not change when its prefix chunks go from private to shared by 60 others."""
    num_kv, group, head_dim, bs = 3, 3, 64, 16
    meta, num_blocks = _shared_prefix_batch(60, bs, prefix_blocks=20)
    k_cache, v_cache = (
        torch.randn(num_blocks, bs, num_kv, head_dim),
        torch.randn(num_blocks, bs, num_kv, head_dim),
    )
    kh, vh = head_major(k_cache), head_major(v_cache)
    q = torch.randn(meta.query_start_loc_list[-1], num_kv * group, head_dim)
    out = paged_attention(q, kh, vh, meta, 0.125, True)
    ref = paged_attention_ref(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125
    )
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for s in (0, 59):
        alone = AttentionMetadata(
            torch.tensor([0, 1], dtype=torch.int32),
            meta.seq_lens[s : s + 1],
            meta.block_tables[s : s + 1],
            torch.zeros(0, dtype=torch.long),
            [0, 1],
            meta.seq_lens_list[s : s + 1],
        )
        assert torch.equal(paged_attention(q[s : s + 1], kh, vh, alone, 0.125, True)[0], out[s])


def _fresh(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.slot_mapping,
        meta.query_start_loc_list,
        meta.seq_lens_list,
    )


def test_every_probed_attention_tile_size_changes_no_bits(monkeypatch):
    """Chunks that few rows meet get the smallest tile the probe found exact on this CPU; with
    only one small size allowed at a time, and with full tiles only, outputs keep every bit."""
    from kernels import attention

    probed = attention.exact_tile_rows(64, torch.float32)
    assert probed[-1] == attention.ATTN_TILE_ROWS and set(probed) <= {
        *attention.ATTN_TILE_LADDER_ROWS,
        attention.ATTN_TILE_ROWS,
    }
    num_kv, group, head_dim, bs = 3, 3, 64, 16
    meta, num_blocks = _shared_prefix_batch(40, bs, prefix_blocks=12)
    kh, vh = (
        torch.randn(num_kv, num_blocks, bs, head_dim),
        torch.randn(num_kv, num_blocks, bs, head_dim),
    )
    q = torch.randn(meta.query_start_loc_list[-1], num_kv * group, head_dim)
    with_probed = paged_attention(q, kh, vh, meta, 0.125, True)
    plan = next(v for v in meta.plans.values() if hasattr(v, "tile_sets"))
    assert {ts.tile_rows for ts in plan.tile_sets} <= set(probed)
    for allowed in [(size, attention.ATTN_TILE_ROWS) for size in probed[:-1]] + [
        (attention.ATTN_TILE_ROWS,)
    ]:
        monkeypatch.setattr(attention, "exact_tile_rows", lambda d, t, allowed=allowed: allowed)
        fresh = _fresh(meta)
        assert torch.equal(paged_attention(q, kh, vh, fresh, 0.125, True), with_probed), allowed
        assert {ts.tile_rows for ts in next(iter(fresh.plans.values())).tile_sets} <= set(allowed)


@pytest.mark.parametrize("group", [1, 3])
def test_attention_decode_rows_alone_equal_rows_in_batch(group):
    """Prompts shared by 1 to 17 decodes: their chunks are met by 1 to 17 * group rows, so the
    batch uses every tile size the probe admits, and a decode alone uses the smallest. Each
    decode's output is the same bits alone and in the batch."""
    num_kv, head_dim, bs = 2, 64, 16
    tables, lens, next_block = [], [], 1
    for sharers in (1, 2, 3, 5, 9, 17):
        prefix = list(range(next_block, next_block + random.randint(8, 20)))
        next_block += len(prefix)
        for _ in range(sharers):
            own = random.randint(1, 2)
            tables.append(prefix + list(range(next_block, next_block + own)))
            next_block += own
            lens.append((len(tables[-1]) - 1) * bs + random.randint(1, bs))
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = list(range(len(tables) + 1))
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        block_tables,
        torch.zeros(0, dtype=torch.long),
        qsl,
        lens,
    )
    kh, vh = (
        torch.randn(num_kv, next_block, bs, head_dim),
        torch.randn(num_kv, next_block, bs, head_dim),
    )
    q = torch.randn(len(tables), num_kv * group, head_dim)
    batched = paged_attention(q, kh, vh, meta, 0.125, True)
    for s in range(len(tables)):
        alone = AttentionMetadata(
            torch.tensor([0, 1], dtype=torch.int32),
            meta.seq_lens[s : s + 1],
            block_tables[s : s + 1],
            torch.zeros(0, dtype=torch.long),
            [0, 1],
            lens[s : s + 1],
        )
        assert torch.equal(
            paged_attention(q[s : s + 1], kh, vh, alone, 0.125, True)[0], batched[s]
        ), s


def test_attention_plan_tiles_only_with_allowed_sizes_and_covers_every_row():
    """CPU-independent: whatever sizes are allowed, each (row, chunk) pair is in exactly one
    tile of an allowed size, and a chunk met by n rows gets full tiles plus one smallest
    allowed tile that holds the rest."""
    from kernels.attention_plan import _tiles_for, build_plan

    for exact in [(16,), (4, 16), (1, 2, 4, 8, 16), (2, 8, 16)]:
        for n in range(1, 80):
            full = n // 16 * 16 if n > 16 else 0
            rest = [(n - full, min(t for t in exact if t >= n - full))] if n > full else []
            assert _tiles_for(n, 16, exact) == [(full, 16)] * (full > 0) + rest, (n, exact)
        seqs = [(random.randint(1, 300), 1) for _ in range(5)] + [(200, 130), (17, 17)]
        meta = make_meta(seqs, 16, 200)
        group, num_kv = 3, 2
        plan = build_plan(
            meta.query_start_loc_list,
            meta.seq_lens_list,
            meta.block_tables.tolist(),
            16,
            group,
            num_kv,
            16,
            128,
            exact,
        )
        assert {ts.tile_rows for ts in plan.tile_sets} <= set(exact)
        # The fold meets chunk c for exactly the rows whose position reaches it: a prefix of
        # its order.
        for r in range(plan.num_rows):
            token = r // group
            seq = next(i for i in range(len(seqs)) if meta.query_start_loc_list[i + 1] > token)
            pos = meta.seq_lens_list[seq] - (meta.query_start_loc_list[seq + 1] - token)
            met = [c for c, count in enumerate(plan.merge_counts) if plan.merge_rank[r] < count]
            assert met == list(range(pos // 128 + 1)), (r, pos, met)
        slots = plan.merge_index.flatten()
        assert plan.merge_index.shape == (num_kv, sum(plan.merge_counts))
        assert slots.unique().numel() == slots.numel() and int(slots.max()) < plan.num_slots
        assert sorted(plan.merge_rank.tolist()) == list(range(plan.num_rows))


def test_store_kv_matches_reference():
    shape = (8, 16, 2, 64)
    slots = torch.tensor(random.sample(range(8 * 16), 20))
    k, v = torch.randn(20, 2, 64), torch.randn(20, 2, 64)
    a = (head_major(torch.zeros(shape)), head_major(torch.zeros(shape)))
    b = (torch.zeros(shape), torch.zeros(shape))
    store_kv(k, v, *a, slots)
    store_kv_ref(k, v, *b, slots)
    assert torch.equal(a[0], head_major(b[0])) and torch.equal(a[1], head_major(b[1]))


def _packed_with(packing: str | None, w: torch.Tensor, monkeypatch) -> torch.Tensor | PackedWeight:
    """``w`` as ``pack_weight`` returns it when ``packing`` is the only one (None: unpacked)."""
    from kernels import linear

    if packing is None:
        return w
    if packing not in linear._available_packings():
        pytest.skip(f"this torch has no {packing} packing")
    monkeypatch.setattr(linear, "_available_packings", lambda: [packing])
    monkeypatch.setattr(linear, "_choice_by_shape", {})
    weight = pack_weight(w)
    assert isinstance(weight, PackedWeight) and weight.packing == packing
    return weight


PACKINGS = [None, "oneDNN", "MKL"]


@pytest.mark.parametrize("packing", PACKINGS, ids=["unpacked", "onednn", "mkl"])
def test_linear_is_batch_invariant_and_correct(packing, monkeypatch):
    """Rows 1..129 taken together, and rows alone, give the bits they get in a 600-row batch:
    the batches' tile plans use every size the probe admitted (up to 512 rows in the big one)."""
    k, n = random.choice([(576, 1536), (1536, 576), (64, 49152)])
    w, x = torch.randn(n, k) * 0.05, torch.randn(600, k)
    bias = torch.randn(n) if random.random() < 0.5 else None
    weight = _packed_with(packing, w, monkeypatch)
    full = batch_invariant_linear(x, weight, bias)
    torch.testing.assert_close(
        full, matmul_ref(x, w) + (0 if bias is None else bias), rtol=1e-4, atol=1e-4
    )
    assert batch_invariant_linear(x[:0], weight, bias).shape == (0, n)
    for m in range(1, 130):
        start = random.randrange(0, 600 - m)
        assert torch.equal(
            batch_invariant_linear(x[start : start + m], weight, bias), full[start : start + m]
        ), m
    for row in random.sample(range(600), 8):
        assert torch.equal(batch_invariant_linear(x[row : row + 1], weight, bias)[0], full[row]), (
            row
        )


def test_every_probed_linear_tile_size_gives_the_reference_bits():
    """What the probe proved on its own random rows holds for another weight of the shape and
    other rows: every admitted tile size, of every packing this torch has, rounds each row as
    the reference tile does."""
    from kernels import linear
    from kernels.torch_compat import packing_ops

    w = torch.randn(960, 576) * 0.05
    x = torch.randn(1024, 576)
    for packing in linear._available_packings():
        ops = packing_ops(packing)
        tile = ops.multiply
        packed = ops.pack(w, linear.LINEAR_TILE_ROWS)
        sizes = linear.probe_tile_rows(packing, packed, w)
        assert linear.LINEAR_TILE_ROWS in sizes and set(sizes) <= set(linear.TILE_LADDER_ROWS)
        ref = torch.cat([tile(x[r : r + 32], packed, w, 32) for r in range(0, 1024, 32)])
        for rows in sizes:
            got = torch.cat([tile(x[r : r + rows], packed, w, rows) for r in range(0, 1024, rows)])
            assert torch.equal(got, ref), (packing, rows)


@pytest.mark.parametrize(
    "tile_rows",
    [
        (32,),
        (4, 8, 16, 32, 64),
        (2, 4, 8, 16, 32, 64, 128, 256, 512),
        (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        (8, 32),
        (32, 64),
    ],
)
def test_tile_plan_uses_proven_sizes_covers_every_row_and_pads_least(tile_rows):
    """CPU-independent: the plan for M rows takes only the given sizes, covers M, costs least
    under the plan's cost model (checked against an exhaustive search), and among plans of
    that cost pads fewest rows."""
    from kernels.linear import _tile_cost, tile_plan

    limit = 700
    best = [(0, 0)] + [None] * limit  # best[n]: least (cost, rows covered) of any cover of n rows
    for num in range(1, limit + 1):
        best[num] = min(
            (best[max(0, num - t)][0] + _tile_cost(t), best[max(0, num - t)][1] + t)
            for t in tile_rows
        )
    assert tile_plan(0, tile_rows) == ()
    for num in range(1, limit + 1):
        plan = tile_plan(num, tile_rows)
        assert set(plan) <= set(tile_rows) and list(plan) == sorted(plan, reverse=True)
        assert sum(plan) >= num and sum(plan) - min(plan) < num, (num, plan)
        assert (sum(_tile_cost(t) for t in plan), sum(plan)) == best[num], (num, plan, best[num])
    if 8 in tile_rows:
        assert tile_plan(8, tile_rows) == (8,)  # a decode of 8 rows: one tile, no padding
    assert tile_plan(max(tile_rows) * 3, tile_rows) == (max(tile_rows),) * 3


def test_probe_choices_are_logged_once(caplog, monkeypatch):
    from kernels import attention, linear

    linear.log_tile_choices()  # what earlier tests packed
    monkeypatch.setattr(linear, "_logged", set())
    shapes = [(96, 64), (96, 64), (64, 96)]
    for shape in shapes:
        pack_weight(torch.randn(*shape))
    with caplog.at_level(logging.INFO, logger="kernels"):
        msg = linear.log_tile_choices()
        again = [pack_weight(torch.randn(*shape)) for shape in shapes]
        assert (
            linear.log_tile_choices() == msg
        )  # the same outcome for the next model: not logged again
        attention.exact_tile_rows.cache_clear()
        sizes = attention.exact_tile_rows(64, torch.float32)
        attention.exact_tile_rows(64, torch.float32)  # cached: probed and logged once
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if line.startswith("linear tiles: ")] == [msg]
    assert linear.cpu_description() in msg and "/3 weights" in msg
    if isinstance(again[0], PackedWeight):
        assert str(list(again[0].tile_rows)) in msg and f"{again[0].packing} packing on" in msg
    else:
        assert "weight packing off" in msg
    attention_lines = [line for line in lines if line.startswith("attention tiles: ")]
    assert len(attention_lines) == 1 and str(list(sizes)) in attention_lines[0]


def test_weights_are_packed_where_this_torch_can():
    from kernels import linear

    weight = pack_weight(torch.randn(96, 64))
    assert isinstance(weight, PackedWeight) == bool(linear._available_packings())
    assert (
        pack_weight(torch.randn(96, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    )  # unpacked


@pytest.mark.parametrize("packing", PACKINGS, ids=["unpacked", "onednn", "mkl"])
@pytest.mark.parametrize("rows", [0, 5, FAST_PLAIN_MIN_ROWS + 3])
def test_fast_linear_is_correct_either_way(rows, packing, monkeypatch):
    w, x, bias = torch.randn(96, 64) * 0.05, torch.randn(rows, 64), torch.randn(96)
    weight = _packed_with(packing, w, monkeypatch)
    torch.testing.assert_close(
        fast_linear(x, weight, bias), matmul_ref(x, w) + bias, rtol=1e-4, atol=1e-4
    )


def test_rms_norm_rows_are_invariant_and_correct():
    x, res, w = torch.randn(257, 576), torch.randn(257, 576), torch.randn(576)
    out, new_res = rms_norm(x, w, 1e-5, res)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, res)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_res, ref_res)
    for m in (1, 3, 64):
        assert torch.equal(rms_norm(x[:m], w, 1e-5, res[:m])[0], out[:m])


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ],
)
def test_rotary_matches_reference(scaling):
    cache = build_cos_sin_cache(64, 2048, 500000.0, scaling)
    pos = torch.randint(0, 2048, (33,))
    q, k = torch.randn(33, 6, 64), torch.randn(33, 2, 64)
    got, ref = apply_rotary(q, k, pos, cache), rotary_ref(q, k, pos, cache)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


def test_store_kv_skips_negative_slots_like_the_reference():
    """A slot < 0 is padding: its row is written nowhere (indexing with -1 would hit the
    last slot)."""
    shape = (8, 16, 2, 64)
    slots = torch.tensor(random.sample(range(8 * 16 - 1), 12))
    slots[[0, 5, 11]] = -1
    k, v = torch.randn(12, 2, 64), torch.randn(12, 2, 64)
    before = (torch.randn(shape), torch.randn(shape))
    a = (head_major(before[0]), head_major(before[1]))
    b = (before[0].clone(), before[1].clone())
    store_kv(k, v, *a, slots)
    store_kv_ref(k, v, *b, slots)
    assert torch.equal(a[0], head_major(b[0])) and torch.equal(a[1], head_major(b[1]))
    written = set(slots[slots >= 0].tolist())
    for slot in set(range(8 * 16)) - written:  # the last slot among them, where -1 would land
        block, offset = divmod(slot, 16)
        assert torch.equal(a[0][:, block, offset], before[0][block, offset])
        assert torch.equal(a[1][:, block, offset], before[1][block, offset])
