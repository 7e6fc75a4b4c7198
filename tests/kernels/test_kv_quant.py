"""The 8-bit KV formats on the torch CPU path, against their reference twins.

Quantizing is checked bitwise against ``quantize_kv_ref`` (the numerics of
``kernels/kv_quant.py``), the store against ``store_kv_ref``, attention over an 8-bit cache
against ``paged_attention_ref`` reading the same bytes, and the batch invariance of the
tiled path bitwise, as for a full-precision cache.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention import AttentionMetadata, paged_attention
from kernels.cache import store_kv
from kernels.kv_quant import dequantize_rows, kv_format, quantize_rows
from kernels.reference import (
    dequantize_kv_ref,
    paged_attention_ref,
    quantize_kv_ref,
    store_kv_ref,
)
from tests.kernels.test_cpu_kernels import head_major, make_meta

QUANTIZED = ["int8", "fp8_e4m3"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_rows_are_the_reference_bits(name):
    fmt = kv_format(name)
    x = torch.randn(9, 3, 64) * torch.logspace(-2, 4, 9)[:, None, None]
    x[0] = 0.0  # an all-zero row: the smallest scale, zeros back
    x[1, 0, 5] = 1e6  # one outlier sets its row's scale alone
    rows = quantize_rows(x, fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (9, 3, 66)
    assert torch.equal(rows, quantize_kv_ref(x, fmt))
    back = dequantize_kv_ref(rows, fmt)
    assert torch.equal(back[0], torch.zeros_like(back[0]))
    assert torch.equal(dequantize_rows(rows, fmt, torch.float32), back.float())
    assert torch.equal(dequantize_rows(rows, fmt, torch.bfloat16), back.float().bfloat16())
    worst = {"int8": 0.5 / 127, "fp8_e4m3": 1 / 16}[name]  # half a step / fp8's 3-bit mantissa
    amax = x.abs().amax(-1, keepdim=True).double()
    assert float(((back - x.double()).abs() / amax.clamp_min(1e-30)).max()) <= worst * 1.01


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_rows_bytes_depend_on_that_row_alone(name):
    fmt = kv_format(name)
    x = torch.randn(40, 2, 32)
    alone = torch.cat([quantize_rows(x[i : i + 1], fmt) for i in range(40)])
    assert torch.equal(alone, quantize_rows(x, fmt))


@pytest.mark.parametrize("name", QUANTIZED)
def test_store_kv_writes_the_reference_bytes(name):
    num_kv, head_dim, bs, num_blocks = 2, 64, 16, 8
    fmt = kv_format(name)
    shape = (num_blocks, bs, num_kv, head_dim + 2)
    k_ref, v_ref = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    k_cpu, v_cpu = head_major(k_ref), head_major(v_ref)
    key, value = torch.randn(20, num_kv, head_dim), torch.randn(20, num_kv, head_dim)
    slots = torch.tensor(random.sample(range(num_blocks * bs), 20), dtype=torch.long)
    slots[3] = -1  # padding is skipped
    store_kv_ref(key, value, k_ref, v_ref, slots, kv_cache_dtype=name)
    store_kv(key, value, k_cpu, v_cpu, slots, fmt)
    assert torch.equal(k_cpu, head_major(k_ref)) and torch.equal(v_cpu, head_major(v_ref))


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("deterministic", [True, False])
def test_attention_over_an_8bit_cache_matches_the_reference(name, deterministic):
    num_kv, group, head_dim, bs, num_blocks = 2, 3, 64, 16, 64
    fmt = kv_format(name)
    seqs = [(1, 1), (17, 17), (300, 1), (33, 16), (129, 40)]
    meta = make_meta(seqs, bs, num_blocks)
    keys = torch.randn(num_blocks, bs, num_kv, head_dim)
    values = torch.randn(num_blocks, bs, num_kv, head_dim)
    k_cache, v_cache = quantize_rows(keys, fmt), quantize_rows(values, fmt)
    q = torch.randn(meta.query_start_loc_list[-1], num_kv * group, head_dim)
    scale = head_dim**-0.5
    out = paged_attention(
        q, head_major(k_cache), head_major(v_cache), meta, scale, deterministic, fmt
    )
    ref = paged_attention_ref(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        kv_cache_dtype=name,
    )
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_attention_over_an_int8_cache_is_batch_and_chunk_invariant():
    num_kv, group, head_dim, bs = 2, 3, 64, 16
    fmt = kv_format("int8")
    ctx = random.randint(150, 300)
    meta_full = make_meta([(ctx, ctx)], bs, 48)
    k_cache = head_major(quantize_rows(torch.randn(48, bs, num_kv, head_dim), fmt))
    v_cache = head_major(quantize_rows(torch.randn(48, bs, num_kv, head_dim), fmt))
    q = torch.randn(ctx, num_kv * group, head_dim)
    full = paged_attention(q, k_cache, v_cache, meta_full, 0.125, True, fmt)

    def rows(ctx_len: int, q_rows: list[int]) -> torch.Tensor:
        meta = AttentionMetadata(
            torch.tensor([0, len(q_rows)], dtype=torch.int32),
            torch.tensor([ctx_len], dtype=torch.int32),
            meta_full.block_tables,
            torch.zeros(0, dtype=torch.long),
            [0, len(q_rows)],
            [ctx_len],
        )
        return paged_attention(q[q_rows], k_cache, v_cache, meta, 0.125, True, fmt)

    assert torch.equal(rows(ctx, [ctx - 1])[0], full[ctx - 1])  # a decode
    for m in (1, 5, 16, 37):  # prefill chunks ending anywhere
        end = random.randrange(m, ctx + 1)
        assert torch.equal(rows(end, list(range(end - m, end))), full[end - m : end])


def test_an_odd_head_dim_or_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="even head_dim"):
        kv_format("int8", head_dim=63)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_format("int4")
