"""Triton unified paged attention against ``paged_attention_ref``, plus its batch invariance.

On the CPU the kernel runs in Triton's interpreter (see conftest), whose ``tl.dot`` is patched
to sum every element's products in one fixed order (``test_triton_interpreter.py`` says why:
the host BLAS would otherwise make the bitwise tests depend on the CPU). Every case draws fresh
inputs, pre-fills the output with NaN so an unwritten element fails, and poisons the cache
slots no query may read (slots past each context, table entries past each sequence) with
NaN, so a read outside the causal window fails too.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import paged_attention_ref
from kernels.triton_attention import KV_CHUNK, paged_attention

TOLERANCES = {  # (atol, rtol) against the float64 reference rounded to the dtype
    torch.float32: (1e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
# (query tokens, context length) per sequence: decodes, lengths at and around the block sizes
# and the KV chunk (16, 32, 64), an empty query, and a chunked prefill with cached prefix.
RAGGED = [(1, 1), (1, 15), (16, 16), (17, 17), (0, 5), (3, 32), (5, 65), (33, 100)]


def make_batch(rng, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """A paged cache holding ``seqs`` [(q_len, ctx_len)] in shuffled blocks, NaN elsewhere."""
    blocks_per_seq = [math.ceil(ctx / block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks - 1, generator=rng) + 1  # block 0 stays all-NaN
    tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for s, (_, ctx) in enumerate(seqs):
        ids = order[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        tables[s, : len(ids)] = ids.int()
        for kv in (k_cache, v_cache):
            values = torch.randn(len(ids) * block_size, num_kv_heads, head_dim, generator=rng)
            values[ctx:] = float("nan")  # slots past the context are never read
            kv[ids] = values.view(len(ids), block_size, num_kv_heads, head_dim).to(dtype)
    q_lens = torch.tensor([q for q, _ in seqs])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=rng).to(dtype)
    seq_lens = torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32)
    args = (query, k_cache, v_cache, tables, query_start_loc, seq_lens)
    return tuple(t.to(device) for t in args)


def run(args, scale):
    out = torch.full_like(args[0], float("nan"))
    result = paged_attention(*args, scale, out=out)
    assert result is out
    return out


def check_matches_reference(rng, device, dtype, group, head_dim, block_size, seqs, num_kv_heads):
    args = make_batch(
        rng, seqs, group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype, device
    )
    scale = head_dim**-0.5
    out = run(args, scale)
    expected = paged_attention_ref(*args, scale)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 32)])
def test_matches_reference(rng, device, dtype, group, head_dim, block_size):
    num_kv_heads = 2 if group < 8 else 1
    check_matches_reference(rng, device, dtype, group, head_dim, block_size, RAGGED, num_kv_heads)


def split_outputs(out, query_start_loc):
    starts = query_start_loc.tolist()
    return [out[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


@pytest.mark.parametrize(
    ("dtype", "group"), [(torch.float32, 4), (torch.bfloat16, 3), (torch.float16, 8)]
)
def test_sequence_output_independent_of_batch(rng, device, dtype, group):
    """A sequence's output is bitwise the same alone and among other sequences."""
    seqs = [(1, 40), (9, 70), (30, 30), (1, 129), (12, 20)]
    args = make_batch(rng, seqs, group * 2, 2, 64, 16, dtype, device)
    query, k_cache, v_cache, tables, query_start_loc, seq_lens = args
    batched = split_outputs(run(args, 0.125), query_start_loc)
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
        assert torch.equal(run(alone_args, 0.125), batched[s]), (
            f"sequence {s} changed with the batch"
        )


def split_into_steps(query, table, total_len, cut_points):
    """One sequence's queries as several pseudo-sequences: prefill chunks, then decodes."""
    bounds = [0, *cut_points, total_len]
    q_lens = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    query_start_loc = torch.tensor([0, *bounds[1:]], dtype=torch.int32, device=query.device)
    seq_lens = torch.tensor(bounds[1:], dtype=torch.int32, device=query.device)
    tables = table.expand(len(q_lens), -1).contiguous()
    return query, tables, query_start_loc, seq_lens


@pytest.mark.parametrize(
    ("dtype", "group", "head_dim"),
    [(torch.float32, 4, 64), (torch.bfloat16, 3, 128), (torch.float16, 1, 64)],
)
def test_prefill_chunks_and_decodes_match_full_prefill_bitwise(rng, device, dtype, group, head_dim):
    """Any split of a sequence into prefill chunks and decodes gives the full prefill's bits."""
    total_len = KV_CHUNK + 27
    args = make_batch(rng, [(total_len, total_len)], group * 2, 2, head_dim, 16, dtype, device)
    query, k_cache, v_cache, tables, _, _ = args
    full = run(args, head_dim**-0.5)
    cuts = sorted(torch.randperm(total_len - 3, generator=rng)[:3].add(1).tolist())
    cuts += [total_len - 2, total_len - 1]  # the last two positions as decodes
    query, split_tables, query_start_loc, seq_lens = split_into_steps(
        query, tables, total_len, cuts
    )
    split = run((query, k_cache, v_cache, split_tables, query_start_loc, seq_lens), head_dim**-0.5)
    assert torch.equal(split, full), f"cut at {cuts}: outputs differ from the full prefill"


def test_rejects_bad_arguments(rng, device):
    args = list(make_batch(rng, [(2, 5)], 4, 2, 64, 16, torch.float16, device))
    with pytest.raises(ValueError, match="k_cache"):
        paged_attention(args[0], args[1].float(), *args[2:], 0.125)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(*args[:3], args[3].long(), *args[4:], 0.125)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(args[0][:, :3], *args[1:], 0.125)
    odd_block = args[1].new_zeros(4, 48, 2, 64)
    with pytest.raises(ValueError, match="block size"):
        paged_attention(args[0], odd_block, odd_block, *args[3:], 0.125)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_realistic_batch_on_gpu(rng, device, dtype):
    """Llama-8B shapes: decodes over ~4k contexts mixed with 512-token prefill chunks."""
    seqs = [(1, int(n)) for n in torch.randint(3000, 4200, (12,), generator=rng)]
    seqs += [(512, 512), (512, 2048 + 7), (77, 77)]
    check_matches_reference(rng, device, dtype, 4, 128, 16, seqs, num_kv_heads=8)


@pytest.mark.cuda
def test_invariance_at_realistic_sizes_on_gpu(rng, device):
    total_len = 1500
    args = make_batch(rng, [(total_len, total_len)], 32, 8, 128, 16, torch.bfloat16, device)
    query, k_cache, v_cache, tables, _, _ = args
    full = run(args, 128**-0.5)
    cuts = [700, 1003, total_len - 1]
    query, split_tables, query_start_loc, seq_lens = split_into_steps(
        query, tables, total_len, cuts
    )
    split = run((query, k_cache, v_cache, split_tables, query_start_loc, seq_lens), 128**-0.5)
    assert torch.equal(split, full)
