"""The Triton kernels over an 8-bit KV cache (``kv_cache_dtype`` int8 / fp8_e4m3).

Like the other Triton tests, these run on the CPU interpreter without a GPU (see conftest)
and on the GPU otherwise. The store's bytes are held bitwise to ``store_kv_ref`` and to
``kv_quant.quantize_rows``, on random rows of many magnitudes and on rows built to land on
every rounding tie of both formats; attention over quantized pages is held to
``paged_attention_ref`` reading the same bytes (a ragged GQA batch of prefill chunks and
decodes), its read-back of every 8-bit code bitwise, and its batch invariance bitwise. Cache
rows no query may read are 0xFF bytes, whose float16 scale is NaN, so a read outside the
causal window fails. ``test_quantized_kernels_compile_for_hopper`` compiles the 8-bit
kernels for sm_90 on a machine without one, as ``test_triton_compile.py`` does for the rest.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kernels import reference, triton_ops
from kernels.kv_quant import MIN_SCALE, dequantize_rows, kv_format, quantize_rows
from kernels.triton_attention import KV_CHUNK, paged_attention
from kernels.triton_cache import store_kv
from tests.kernels.test_triton_attention import RAGGED, TOLERANCES, split_outputs

QUANTIZED = ["int8", "fp8_e4m3"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
POISON = 0xFF
"""Bytes of cache rows nobody may read: the row's float16 scale is NaN."""


def spread_rows(rng, *shape):
    """Normal rows, each scaled by its own 10**U(-4, 3): scales from float16 subnormals to
    thousands, so every row exercises a different exponent."""
    exponents = torch.empty(*shape[:-1], 1).uniform_(-4.0, 3.0, generator=rng)
    return torch.randn(*shape, generator=rng) * 10.0**exponents


# ---------------------------------------------------------------------------------------
# store


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(16, 2, 64), (32, 3, 96)])
def test_store_writes_the_reference_bytes(
    rng, device, kv_cache_dtype, dtype, block_size, num_kv_heads, head_dim
):
    num_blocks, num_tokens = 5, 23
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[:4]] = -1  # padding tokens: skipped
    key = spread_rows(rng, num_tokens, num_kv_heads, head_dim)
    key[0] = 0.0  # all-zero rows: the smallest scale
    key[1, 0, 5] = 3e4  # one outlier sets its row's scale alone
    key[2] *= 1e-9  # below MIN_SCALE * qmax: the scale is clamped
    key, value = key.to(dtype), spread_rows(rng, num_tokens, num_kv_heads, head_dim).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim + 2)
    k_expected = torch.full(shape, POISON, dtype=torch.uint8)
    v_expected = k_expected.clone()
    reference.store_kv_ref(key, value, k_expected, v_expected, slots, kv_cache_dtype)
    k_cache, v_cache = k_expected.new_full(shape, POISON), v_expected.new_full(shape, POISON)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    store_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device), kv_cache_dtype)
    assert torch.equal(k_cache.cpu(), k_expected)
    assert torch.equal(v_cache.cpu(), v_expected)
    mapped = slots >= 0
    fmt = kv_format(kv_cache_dtype)
    stored = k_cache.cpu().view(-1, num_kv_heads, head_dim + 2)[slots[mapped]]
    assert torch.equal(stored, quantize_rows(key[mapped], fmt))


def tie_rows(kv_cache_dtype: str, head_dim: int) -> torch.Tensor:
    """float32 rows whose scaled values are every rounding tie of the format (and the floats
    on either side of each), rows of tiny, zero, negative-zero and large values."""
    fmt = kv_format(kv_cache_dtype)
    if kv_cache_dtype == "int8":
        ties = torch.arange(-127, 127, dtype=torch.float32) + 0.5
    else:  # midpoints between consecutive finite float8_e4m3fn values, normal and subnormal
        codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = (codes[:-1] + codes[1:]) / 2
        ties = torch.cat([mids, -mids])
    inf = torch.tensor(float("inf"))
    targets = torch.cat([ties, torch.nextafter(ties, inf), torch.nextafter(ties, -inf)])
    width = head_dim - 1  # each row's first value is qmax, so its scale is exactly `step`
    targets = torch.cat([targets, targets.new_zeros(-len(targets) % width)]).view(-1, width)
    step = 2.0**-3
    rows = torch.cat([targets.new_full((len(targets), 1), fmt.qmax), targets], dim=1) * step
    special = torch.stack(
        [
            torch.zeros(head_dim),
            torch.full((head_dim,), -0.0),
            torch.linspace(-1, 1, head_dim) * MIN_SCALE,  # far below the smallest scale
            torch.linspace(-1, 1, head_dim) * 3e-3,  # a float16-subnormal scale
            torch.linspace(-1, 1, head_dim) * 7e6,  # scale near float16's largest
        ]
    )
    return torch.cat([rows, special])


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_store_rounds_every_tie_like_torch(device, kv_cache_dtype):
    head_dim, block_size = 64, 16
    fmt = kv_format(kv_cache_dtype)
    key = tie_rows(kv_cache_dtype, head_dim)[:, None, :]  # [rows, Hkv=1, D]
    num_rows = key.shape[0]
    num_blocks = math.ceil(num_rows / block_size)
    shape = (num_blocks, block_size, 1, head_dim + 2)
    k_cache = torch.full(shape, POISON, dtype=torch.uint8, device=device)
    v_cache = k_cache.clone()
    slots = torch.arange(num_rows, device=device)
    store_kv(key.to(device), (-key).to(device), k_cache, v_cache, slots, kv_cache_dtype)
    for cache, x in ((k_cache, key), (v_cache, -key)):
        got = cache.cpu().view(-1, 1, head_dim + 2)[:num_rows]
        assert torch.equal(got, quantize_rows(x, fmt))
        assert torch.equal(got, reference.quantize_kv_ref(x, fmt))


# ---------------------------------------------------------------------------------------
# attention


def make_quant_batch(
    rng, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device, kv_cache_dtype
):
    """``test_triton_attention.make_batch`` over an 8-bit cache: each sequence's K/V rows
    (normal, drawn in ``dtype``) quantized into shuffled blocks, 0xFF bytes elsewhere."""
    fmt = kv_format(kv_cache_dtype)
    blocks_per_seq = [math.ceil(ctx / block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim + 2)
    k_cache = torch.full(shape, POISON, dtype=torch.uint8)
    v_cache = torch.full(shape, POISON, dtype=torch.uint8)
    order = torch.randperm(num_blocks - 1, generator=rng) + 1  # block 0 stays poisoned
    tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for s, (_, ctx) in enumerate(seqs):
        ids = order[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        tables[s, : len(ids)] = ids.int()
        for kv in (k_cache, v_cache):
            pages = torch.full((len(ids) * block_size, *shape[2:]), POISON, dtype=torch.uint8)
            x = torch.randn(ctx, num_kv_heads, head_dim, generator=rng).to(dtype)
            pages[:ctx] = quantize_rows(x, fmt)
            kv[ids] = pages.view(len(ids), *shape[1:])
    q_lens = torch.tensor([q for q, _ in seqs])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=rng).to(dtype)
    seq_lens = torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32)
    args = (query, k_cache, v_cache, tables, query_start_loc, seq_lens)
    return tuple(t.to(device) for t in args)


def run(args, scale, kv_cache_dtype):
    out = torch.full_like(args[0], float("nan"))
    result = paged_attention(*args, scale, kv_cache_dtype, out=out)
    assert result is out
    return out


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_size"),
    [
        (torch.float32, 4, 64, 16),
        (torch.float16, 3, 64, 16),
        (torch.bfloat16, 4, 128, 32),
    ],
)
def test_attention_matches_reference(
    rng, device, kv_cache_dtype, dtype, group, head_dim, block_size
):
    """Ragged GQA batch: decodes, prefill chunks over a cached prefix, an empty query.

    The kernel reads K/V back in the query's dtype (the format's numerics), the reference
    in float64; with normal K/V rows that rounding took at most 0.35 of the tolerances over
    60 seeds (rows scaled up to 3x, sharpening the softmax, took 0.93)."""
    num_kv_heads = 2
    args = make_quant_batch(
        rng, RAGGED, group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype, device,
        kv_cache_dtype,
    )  # fmt: skip
    scale = head_dim**-0.5
    out = run(args, scale, kv_cache_dtype)
    expected = reference.paged_attention_ref(*args, scale, kv_cache_dtype)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_attention_reads_every_code_back_exactly(device, kv_cache_dtype):
    """Over one key the output is that key's value row, bit for bit (float32 queries): so
    it is ``dequantize_rows``'s read-back of each of the format's codes, scaled."""
    fmt = kv_format(kv_cache_dtype)
    head_dim, block_size = 64, 16
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if kv_cache_dtype == "fp8_e4m3":
        codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes
    codes = torch.cat([codes, codes[: -len(codes) % head_dim]]).view(-1, head_dim)
    num_seqs = codes.shape[0]
    scales = torch.tensor([1.0, 2.0**-20, 3.5, 1000.0], dtype=torch.float16)[:num_seqs]
    v_rows = torch.cat([codes, scales.view(-1, 1).view(torch.uint8)], dim=1)
    k_rows = quantize_rows(torch.zeros(num_seqs, head_dim), fmt)  # all scores 0
    shape = (num_seqs, block_size, 1, head_dim + 2)
    k_cache = torch.full(shape, POISON, dtype=torch.uint8)
    v_cache = torch.full(shape, POISON, dtype=torch.uint8)
    k_cache[:, 0, 0], v_cache[:, 0, 0] = k_rows, v_rows
    tables = torch.arange(num_seqs, dtype=torch.int32).view(-1, 1)
    query = torch.randn(num_seqs, 2, head_dim)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    seq_lens = torch.ones(num_seqs, dtype=torch.int32)
    args = (query, k_cache, v_cache, tables, query_start_loc, seq_lens)
    out = run(tuple(t.to(device) for t in args), 0.125, kv_cache_dtype).cpu()
    expected = dequantize_rows(v_rows, fmt, torch.float32)
    assert torch.equal(out, expected[:, None, :].expand(-1, 2, -1))


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype"), [("int8", torch.bfloat16), ("fp8_e4m3", torch.float16)]
)
def test_sequence_output_independent_of_batch(rng, device, kv_cache_dtype, dtype):
    """A sequence's output is bitwise the same alone and among other sequences."""
    seqs = [(1, 40), (9, 70), (30, 30), (1, 129), (12, 20)]
    args = make_quant_batch(rng, seqs, 8, 2, 64, 16, dtype, device, kv_cache_dtype)
    query, k_cache, v_cache, tables, query_start_loc, seq_lens = args
    batched = split_outputs(run(args, 0.125, kv_cache_dtype), query_start_loc)
    for s in range(len(seqs)):
        rows = slice(int(query_start_loc[s]), int(query_start_loc[s + 1]))
        alone_args = (
            query[rows],
            k_cache,
            v_cache,
            tables[s : s + 1],
            query_start_loc[s : s + 2] - query_start_loc[s],
            seq_lens[s : s + 1],
        )
        assert torch.equal(run(alone_args, 0.125, kv_cache_dtype), batched[s]), (
            f"sequence {s} changed with the batch"
        )


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype"), [("int8", torch.float32), ("fp8_e4m3", torch.float16)]
)
def test_prefill_chunks_and_decodes_match_full_prefill_bitwise(rng, device, kv_cache_dtype, dtype):
    """Any split of a sequence into prefill chunks and decodes gives the full prefill's bits."""
    total_len = KV_CHUNK + 27
    args = make_quant_batch(
        rng, [(total_len, total_len)], 6, 2, 64, 16, dtype, device, kv_cache_dtype
    )
    query, k_cache, v_cache, tables, _, _ = args
    full = run(args, 0.125, kv_cache_dtype)
    cuts = sorted(torch.randperm(total_len - 3, generator=rng)[:3].add(1).tolist())
    cuts += [total_len - 2, total_len - 1]  # the last two positions as decodes
    bounds = [0, *cuts, total_len]
    split_args = (
        query,
        k_cache,
        v_cache,
        tables.expand(len(bounds) - 1, -1).contiguous(),
        torch.tensor(bounds, dtype=torch.int32, device=query.device),
        torch.tensor(bounds[1:], dtype=torch.int32, device=query.device),
    )
    assert torch.equal(run(split_args, 0.125, kv_cache_dtype), full), f"cut at {cuts}"


# ---------------------------------------------------------------------------------------
# facade and argument checks


def test_facade_forwards_kv_cache_dtype(rng, device):
    args = make_quant_batch(rng, [(3, 20), (1, 9)], 4, 2, 64, 16, torch.float16, device, "int8")
    query, k_cache, v_cache, tables, query_start_loc, seq_lens = args
    direct = paged_attention(*args, 0.125, "int8")
    via_facade = triton_ops.paged_attention(*args, 0.125, kv_cache_dtype="int8")
    assert torch.equal(direct, via_facade)
    key = torch.randn(3, 2, 64, generator=rng).to(device, torch.float16)
    slots = torch.tensor([5, -1, 40], device=device)
    k_direct, v_direct = k_cache.clone(), v_cache.clone()
    store_kv(key, -key, k_direct, v_direct, slots, "fp8_e4m3")
    triton_ops.store_kv(key, -key, k_cache, v_cache, slots, kv_cache_dtype="fp8_e4m3")
    assert torch.equal(k_cache, k_direct) and torch.equal(v_cache, v_direct)


def test_rejects_bad_arguments(rng, device):
    key = torch.randn(2, 2, 64, generator=rng).to(device)
    slots = torch.tensor([0, 1], device=device)
    cache = torch.zeros(2, 16, 2, 66, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        store_kv(key, key, cache, cache, slots, "int4")
    with pytest.raises(ValueError, match="k_cache"):  # a float cache for an 8-bit format
        store_kv(key, key, cache[..., :64].float(), cache[..., :64].float(), slots, "int8")
    with pytest.raises(ValueError, match="key"):  # rows of D + 2 bytes hold D = 64 values
        store_kv(key[..., :62], key[..., :62], cache, cache, slots, "int8")
    odd = torch.zeros(2, 16, 2, 67, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="even head_dim"):
        store_kv(key[..., :65], key[..., :65], odd, odd, slots, "int8")
    flat = torch.zeros(2 * 16 * 2 * 66 + 1, dtype=torch.uint8, device=device)
    shifted = flat[1:].view(2, 16, 2, 66)  # an odd address: the scales would be misaligned
    with pytest.raises(ValueError, match="even address"):
        store_kv(key, key, shifted, shifted, slots, "fp8_e4m3")

    args = list(make_quant_batch(rng, [(2, 5)], 4, 2, 64, 16, torch.float16, device, "int8"))
    with pytest.raises(ValueError, match="k_cache"):  # bytes read as a full-precision cache
        paged_attention(*args, 0.125)
    with pytest.raises(ValueError, match="k_cache"):  # the wrong row width
        paged_attention(args[0][..., :62], *args[1:], 0.125, "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        paged_attention(*args, 0.125, "fp8")


# ---------------------------------------------------------------------------------------
# sm_90 compilation (no GPU needed) and realistic sizes on a GPU


@contextlib.contextmanager
def keeping_compiled_kernels():
    """The kernels ``triton.compile`` returns meanwhile (``compile_kernel`` keeps only counts)."""
    import triton

    kept, original = [], triton.compile

    def compile_and_keep(*args, **kwargs):
        kept.append(original(*args, **kwargs))
        return kept[-1]

    triton.compile = compile_and_keep
    try:
        yield kept
    finally:
        triton.compile = original


def compile_quantized(kv_cache_dtype: str) -> dict:
    """Compile the 8-bit attention and store kernels for sm_90 (Llama-8B shapes, bf16); the
    store's report counts its float divisions by kind in the PTX."""
    from kernels import triton_attention as attn
    from kernels import triton_cache as cache
    from tests.kernels.test_triton_compile import compile_kernel

    fmt = kv_format(kv_cache_dtype)
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    width = head_dim + 2
    group = heads // kv_heads
    values = dict(out_ptr="*bf16", q_ptr="*bf16", k_cache_ptr="*u8", v_cache_ptr="*u8")
    values.update(block_tables_ptr="*i32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32")
    values.update(qk_scale_log2="fp32", num_seqs=64, stride_bt=257)
    values.update(stride_ot=heads * head_dim, stride_qt=heads * head_dim, stride_oh=head_dim)
    values.update(stride_qh=head_dim, stride_kh=width, stride_vh=width)
    values.update(stride_kb=block_size * kv_heads * width, stride_ko=kv_heads * width)
    values.update(stride_vb=block_size * kv_heads * width, stride_vo=kv_heads * width)
    block_m = max(attn.BLOCK_M, group)
    attention = compile_kernel(
        attn._paged_attention_quant_kernel,
        values,
        dict(
            GROUP=group,
            GROUP_PAD=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_Q=block_m // group,
            KV_CHUNK=attn.KV_CHUNK,
            DOT_PRECISION="tf32",
            KV_QUANT=cache.KV_QUANT_CODES[kv_cache_dtype],
        ),
        num_warps=attn.NUM_WARPS,
        num_stages=2,
    )
    values = dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*u8", v_cache_ptr="*u8")
    values.update(slot_mapping_ptr="*i64", stride_kt=kv_heads * head_dim, stride_kh=head_dim)
    values.update(stride_vt=kv_heads * head_dim, stride_vh=head_dim)
    values.update(stride_kcb=block_size * kv_heads * width, stride_kco=kv_heads * width)
    values.update(stride_vcb=block_size * kv_heads * width, stride_vco=kv_heads * width)
    values.update(stride_kch=width, stride_vch=width)
    with keeping_compiled_kernels() as kept:
        store = compile_kernel(
            cache._store_kv_kernel,
            values,
            dict(
                NUM_KV_HEADS=kv_heads,
                HEAD_DIM=head_dim,
                BLOCK_SIZE=block_size,
                HEADS_PAD=kv_heads,
                DIM_PAD=head_dim,
                KV_QUANT=cache.KV_QUANT_CODES[kv_cache_dtype],
                QMAX=fmt.qmax,
                MIN_SCALE=MIN_SCALE,
            ),
            num_warps=cache.NUM_WARPS,
        )
    ptx = kept[-1].asm["ptx"]
    store["rn_divisions"] = ptx.count("div.rn.f32") + ptx.count("div.rn.ftz.f32")
    store["approximate_divisions"] = ptx.count("div.full.f32") + ptx.count("div.approx.f32")
    return {"attention": attention, "store": store}


def test_quantized_kernels_compile_for_hopper():
    """The GPU compiler accepts what the interpreter ran (pointer casts to the float16 scale,
    the bit-level roundings), the store divides as IEEE does (``div.rn``: what makes it
    bit-exact with torch on the GPU too) and the 8-bit attention still uses warpgroup MMA."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "tests.kernels.test_triton_kv_quant", *QUANTIZED]
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        command, cwd=repo_root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name in QUANTIZED:
        assert report[name]["attention"]["warpgroup_dots"] > 0, report
        assert report[name]["store"]["rn_divisions"] > 0, report
        assert report[name]["store"]["approximate_divisions"] == 0, report


@pytest.mark.cuda
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_realistic_sizes_on_gpu(rng, device, kv_cache_dtype):
    """Llama-8B shapes: the store bitwise against torch, then decodes over ~4k contexts mixed
    with 512-token prefill chunks against the reference."""
    fmt = kv_format(kv_cache_dtype)
    key = spread_rows(rng, 2048, 8, 128).to(device, torch.bfloat16)
    k_cache = torch.full((4096, 16, 8, 130), POISON, dtype=torch.uint8, device=device)
    v_cache = k_cache.clone()
    slots = torch.randperm(4096 * 16, generator=rng)[:2048].to(device)
    store_kv(key, -key, k_cache, v_cache, slots, kv_cache_dtype)
    assert torch.equal(k_cache.view(-1, 8, 130)[slots].cpu(), quantize_rows(key.cpu(), fmt))
    assert torch.equal(v_cache.view(-1, 8, 130)[slots].cpu(), quantize_rows(-key.cpu(), fmt))

    seqs = [(1, int(n)) for n in torch.randint(3000, 4200, (12,), generator=rng)]
    seqs += [(512, 512), (512, 2048 + 7), (77, 77)]
    args = make_quant_batch(rng, seqs, 32, 8, 128, 16, torch.bfloat16, device, kv_cache_dtype)
    out = run(args, 128**-0.5, kv_cache_dtype)
    expected = reference.paged_attention_ref(*args, 128**-0.5, kv_cache_dtype)
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


if __name__ == "__main__":
    print(json.dumps({name: compile_quantized(name) for name in sys.argv[1:]}))
