"""Triton KV-cache store, fused residual + RMSNorm and rotary against their torch twins.

Also checks the facade ``kernels/triton_ops.py``: same parameters as ``kernels/reference.py``
and the same results as the kernel modules it forwards to.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import reference, triton_ops
from kernels.rotary import build_cos_sin_cache
from kernels.triton_cache import store_kv
from kernels.triton_norm import rms_norm
from kernels.triton_rotary import rotary

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(16, 2, 64), (32, 3, 128)])
def test_store_kv_writes_only_mapped_slots(rng, device, dtype, block_size, num_kv_heads, head_dim):
    num_blocks, num_tokens = 5, 23
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[:4]] = -1  # padding tokens: skipped
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=rng).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=rng).to(dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.full(cache_shape, float("nan"), dtype=dtype) for _ in range(2))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.store_kv_ref(key, value, k_expected, v_expected, slots)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    store_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device))
    torch.testing.assert_close(k_cache.cpu(), k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), v_expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden_size", [64, 100])
def test_rms_norm_matches_reference(rng, device, dtype, with_residual, hidden_size):
    x = torch.randn(9, hidden_size, generator=rng).to(device, dtype)
    residual = (
        torch.randn(9, hidden_size, generator=rng).to(device, dtype) if with_residual else None
    )
    weight = (1 + torch.randn(hidden_size, generator=rng) / 4).to(device, dtype)
    out = torch.full_like(x, float("nan"))
    residual_out = torch.full_like(x, float("nan"))
    normed, new_residual = rms_norm(x, weight, 1e-6, residual, out=out, residual_out=residual_out)
    expected, expected_residual = reference.rms_norm_ref(x, weight, 1e-6, residual)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(normed, expected, atol=atol, rtol=rtol)
    assert torch.equal(new_residual, expected_residual)  # one rounding of an exact sum
    assert normed is out and new_residual is residual_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_are_bitwise_independent_of_batch(rng, device, dtype):
    x = torch.randn(12, 96, 64, generator=rng).to(device, dtype)  # extra leading dims
    residual = torch.randn(12, 96, 64, generator=rng).to(device, dtype)[:, 0]
    weight = torch.randn(64, generator=rng).to(device, dtype)
    full, _ = rms_norm(x[:, 0], weight, 1e-5, residual)
    for row in torch.randint(0, 12, (3,), generator=rng).tolist():
        alone, _ = rms_norm(x[row, 0:1], weight, 1e-5, residual[row : row + 1])
        assert torch.equal(alone[0], full[row])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads"), [(64, 4, 4), (128, 6, 2), (64, 8, 1)]
)
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING])
def test_rotary_matches_reference(
    rng, device, dtype, head_dim, num_heads, num_kv_heads, rope_scaling
):
    max_positions, num_tokens = 256, 11
    cos_sin = build_cos_sin_cache(head_dim, max_positions, 10000.0, rope_scaling, torch.float32)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=rng)
    positions[:2] = torch.tensor([0, max_positions - 1])
    query = torch.randn(num_tokens, num_heads, head_dim, generator=rng).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=rng).to(dtype)
    expected = reference.rotary_ref(query, key, positions, cos_sin)
    query, key, positions, cos_sin = (t.to(device) for t in (query, key, positions, cos_sin))
    outs = (torch.full_like(query, float("nan")), torch.full_like(key, float("nan")))
    got = rotary(query, key, positions, cos_sin, query_out=outs[0], key_out=outs[1])
    atol, rtol = TOLERANCES[dtype]
    for g, e, o in zip(got, expected, outs, strict=True):
        assert g is o
        torch.testing.assert_close(g.cpu(), e, atol=atol, rtol=rtol)


def test_rotary_rejects_odd_head_dim_and_mismatched_key(rng, device):
    q = torch.randn(3, 2, 64, generator=rng).to(device)
    cos_sin = torch.randn(8, 64).to(device)
    positions = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="key"):
        rotary(q, q[:, :, :32], positions, cos_sin)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary(q, q, positions, cos_sin[:, :32])
    odd = torch.randn(3, 2, 63, generator=rng).to(device)
    with pytest.raises(ValueError, match="even"):
        rotary(odd, odd, positions, cos_sin[:, :63])


@pytest.mark.parametrize("name", ["store_kv", "paged_attention", "rms_norm", "rotary", "matmul"])
def test_facade_has_reference_signatures(name):
    ours = inspect.signature(getattr(triton_ops, name)).parameters
    theirs = inspect.signature(getattr(reference, f"{name}_ref")).parameters
    assert list(ours) == list(theirs)
    assert triton_ops.triton_available()


def test_facade_forwards_to_the_kernels(rng, device):
    x = torch.randn(5, 48, generator=rng).to(device)
    weight = torch.randn(24, 48, generator=rng).to(device)
    assert torch.equal(triton_ops.matmul(x, weight)[2], triton_ops.matmul(x[2:3], weight)[0])
    torch.testing.assert_close(triton_ops.matmul(x, weight), reference.matmul_ref(x, weight))
    normed, _ = triton_ops.rms_norm(x, weight[0], 1e-6)
    torch.testing.assert_close(normed, reference.rms_norm_ref(x, weight[0], 1e-6)[0])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_realistic_sizes_on_gpu(rng, device, dtype):
    """Llama-3-8B sizes: 2048 tokens, hidden 4096, 32/8 heads of 128, a 64k-slot cache."""
    num_tokens, hidden_size = 2048, 4096
    x = torch.randn(num_tokens, hidden_size, generator=rng).to(device, dtype)
    residual = torch.randn(num_tokens, hidden_size, generator=rng).to(device, dtype)
    weight = torch.randn(hidden_size, generator=rng).to(device, dtype)
    normed, new_residual = rms_norm(x, weight, 1e-5, residual)
    expected, expected_residual = reference.rms_norm_ref(x, weight, 1e-5, residual)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(normed, expected, atol=atol, rtol=rtol)
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(rms_norm(x[7:8], weight, 1e-5, residual[7:8])[0][0], normed[7])

    cos_sin = build_cos_sin_cache(
        128, 8192, 500000.0, {**LLAMA3_SCALING, "original_max_position_embeddings": 8192}
    )
    positions = torch.randint(0, 8192, (num_tokens,), generator=rng).to(device)
    query = torch.randn(num_tokens, 32, 128, generator=rng).to(device, dtype)
    key = torch.randn(num_tokens, 8, 128, generator=rng).to(device, dtype)
    got = rotary(query, key, positions, cos_sin.to(device))
    for g, e in zip(
        got, reference.rotary_ref(query, key, positions, cos_sin.to(device)), strict=True
    ):
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)

    k_cache = torch.full((4096, 16, 8, 128), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    slots = torch.randperm(4096 * 16, generator=rng)[:num_tokens].to(device)
    store_kv(key, key, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 8, 128)[slots], key)
    assert torch.equal(v_cache.view(-1, 8, 128)[slots], key)
    assert int(k_cache.view(-1, 8 * 128).isnan().all(dim=1).sum()) == 4096 * 16 - num_tokens
