"""The torch CPU kernels against their reference twins, and their batch invariance.

Every case draws fresh random inputs. Batch invariance is checked bitwise: a row computed
alone equals the same row computed among others, and a query's attention output is the same
whether it is computed in one prefill, split across prefill chunks, or as a decode.
"""

from __future__ import annotations

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
        torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32), torch.tensor(slots, dtype=torch.long), qsl, lens,
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
    out = paged_attention(q, head_major(k_cache), head_major(v_cache), meta, head_dim**-0.5, deterministic)
    ref = paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, head_dim**-0.5)
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
        meta = AttentionMetadata(torch.tensor([0, len(q_rows)], dtype=torch.int32), torch.tensor([ctx_len], dtype=torch.int32),
                                 table, torch.zeros(0, dtype=torch.long), [0, len(q_rows)], [ctx_len])
        return paged_attention(q[q_rows], k_cache, v_cache, meta, 0.125, True)
    # Decode of the last token, a chunk in the middle, and the same among other sequences.
    assert torch.equal(one(ctx, [ctx - 1])[0], full[ctx - 1])
    mid = list(range(ctx // 2, ctx // 2 + 37))
    assert torch.equal(one(ctx // 2 + 37, mid), full[mid])
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
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             torch.tensor(padded, dtype=torch.int32), torch.zeros(0, dtype=torch.long), qsl, lens)
    return meta, next_block


def test_attention_over_shared_prefix_matches_reference_and_is_invariant():
    """Chunks shared by many sequences are read once (kernels/attention_plan.py); a decode's
    output must not change when its prefix chunks go from private to shared by 60 others."""
    num_kv, group, head_dim, bs = 3, 3, 64, 16
    meta, num_blocks = _shared_prefix_batch(60, bs, prefix_blocks=20)
    k_cache, v_cache = torch.randn(num_blocks, bs, num_kv, head_dim), torch.randn(num_blocks, bs, num_kv, head_dim)
    kh, vh = head_major(k_cache), head_major(v_cache)
    q = torch.randn(meta.query_start_loc_list[-1], num_kv * group, head_dim)
    out = paged_attention(q, kh, vh, meta, 0.125, True)
    ref = paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for s in (0, 59):
        alone = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), meta.seq_lens[s : s + 1],
                                  meta.block_tables[s : s + 1], torch.zeros(0, dtype=torch.long),
                                  [0, 1], meta.seq_lens_list[s : s + 1])
        assert torch.equal(paged_attention(q[s : s + 1], kh, vh, alone, 0.125, True)[0], out[s])


def test_small_tiles_for_private_decode_chunks_change_no_bits(monkeypatch):
    """A decode's own last chunk gets a 4-row tile instead of a mostly padded 16-row one, where
    this CPU computes a row alike in both; outputs keep every bit."""
    from kernels import attention

    if not attention.small_tiles_are_exact(64, torch.float32):
        pytest.skip("this CPU's bmm rounds 4-row tiles differently: full tiles only, nothing to compare")
    num_kv, group, head_dim, bs = 3, 3, 64, 16
    meta, num_blocks = _shared_prefix_batch(40, bs, prefix_blocks=12)
    kh, vh = torch.randn(num_kv, num_blocks, bs, head_dim), torch.randn(num_kv, num_blocks, bs, head_dim)
    q = torch.randn(meta.query_start_loc_list[-1], num_kv * group, head_dim)
    with_small = paged_attention(q, kh, vh, meta, 0.125, True)
    plan = next(v for v in meta.plans.values() if hasattr(v, "tile_sets"))
    assert sorted(ts.tile_rows for ts in plan.tile_sets) == [attention.SMALL_TILE_ROWS, attention.ATTN_TILE_ROWS]
    monkeypatch.setattr(attention, "SMALL_TILE_ROWS", 0)  # group 3 > 0: full tiles only
    fresh = AttentionMetadata(meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping,
                              meta.query_start_loc_list, meta.seq_lens_list)
    assert torch.equal(paged_attention(q, kh, vh, fresh, 0.125, True), with_small)
    assert [ts.tile_rows for ts in next(iter(fresh.plans.values())).tile_sets] == [attention.ATTN_TILE_ROWS]


def test_store_kv_matches_reference():
    shape = (8, 16, 2, 64)
    slots = torch.tensor(random.sample(range(8 * 16), 20))
    k, v = torch.randn(20, 2, 64), torch.randn(20, 2, 64)
    a = (head_major(torch.zeros(shape)), head_major(torch.zeros(shape)))
    b = (torch.zeros(shape), torch.zeros(shape))
    store_kv(k, v, *a, slots)
    store_kv_ref(k, v, *b, slots)
    assert torch.equal(a[0], head_major(b[0])) and torch.equal(a[1], head_major(b[1]))


@pytest.mark.parametrize("packed", [False, True], ids=["tiles", "mkl-packed-tiles"])
def test_linear_is_batch_invariant_and_correct(packed):
    k, n = random.choice([(576, 1536), (1536, 576), (64, 49152)])
    w, x = torch.randn(n, k) * 0.05, torch.randn(300, k)
    bias = torch.randn(n) if random.random() < 0.5 else None
    weight = pack_weight(w) if packed else w
    if packed and torch.backends.mkl.is_available():
        assert isinstance(weight, PackedWeight), "this torch has MKL: the weight should have been packed"
    full = batch_invariant_linear(x, weight, bias)
    torch.testing.assert_close(full, matmul_ref(x, w) + (0 if bias is None else bias), rtol=1e-4, atol=1e-4)
    for m in (0, 1, 2, 7, 33, 64, 129):
        start = random.randrange(0, 300 - m)
        assert torch.equal(batch_invariant_linear(x[start : start + m], weight, bias), full[start : start + m]), m


def test_packed_weights_give_the_bits_of_unpacked_tiles():
    """Packing is a speed-up only: a model's outputs are the same bits with or without it."""
    w, x = torch.randn(960, 576) * 0.05, torch.randn(70, 576)
    assert torch.equal(batch_invariant_linear(x, pack_weight(w)), batch_invariant_linear(x, w))


@pytest.mark.parametrize("rows", [5, FAST_PLAIN_MIN_ROWS + 3])
def test_fast_linear_is_correct_either_way(rows):
    w, x, bias = torch.randn(96, 64) * 0.05, torch.randn(rows, 64), torch.randn(96)
    for weight in (w, pack_weight(w)):
        torch.testing.assert_close(fast_linear(x, weight, bias), matmul_ref(x, w) + bias, rtol=1e-4, atol=1e-4)


def test_rms_norm_rows_are_invariant_and_correct():
    x, res, w = torch.randn(257, 576), torch.randn(257, 576), torch.randn(576)
    out, new_res = rms_norm(x, w, 1e-5, res)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, res)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_res, ref_res)
    for m in (1, 3, 64):
        assert torch.equal(rms_norm(x[:m], w, 1e-5, res[:m])[0], out[:m])


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}])
def test_rotary_matches_reference(scaling):
    cache = build_cos_sin_cache(64, 2048, 500000.0, scaling)
    pos = torch.randint(0, 2048, (33,))
    q, k = torch.randn(33, 6, 64), torch.randn(33, 2, 64)
    got, ref = apply_rotary(q, k, pos, cache), rotary_ref(q, k, pos, cache)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


def test_store_kv_skips_negative_slots_like_the_reference():
    """A slot < 0 is padding: its row is written nowhere (indexing with -1 would hit the last slot)."""
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
