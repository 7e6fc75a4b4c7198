"""Slow, obviously-correct torch twins of every kernel in ``kernels/``.

Tests compare each fast path (the torch CPU path in ``kernels/attention.py`` and the Triton
kernels) against these. They favour clarity over speed: Python loops over sequences, float64
where it makes the answer exact enough to be the yardstick.

Data layout (shared by every implementation)
    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables     : [num_seqs, max_blocks_per_seq] int32; entries past a sequence's last
                       block are unspecified (never read).
    query_start_loc  : [num_seqs + 1] int32, cumulative query lengths (the ragged batch).
    seq_lens         : [num_seqs] int32, each sequence's context length *including* the new
                       query tokens. Query token j of sequence s (0-based within the query)
                       sits at position ``seq_lens[s] - q_len[s] + j`` and attends causally to
                       positions ``0 .. that position``.
    slot_mapping     : [num_tokens] int64, ``block_id * block_size + offset`` of each new token;
                       a slot < 0 is padding, skipped by every ``store_kv``.
    With an 8-bit KV format (``kernels/kv_quant.py``) the caches are uint8 and their last
    dimension is ``head_dim + 2``: each row's 8-bit values, then its float16 scale.
"""

from __future__ import annotations

import torch

from kernels.kv_quant import FORMATS, KVFormat


def quantize_kv_ref(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """One row at a time, ``kernels/kv_quant.py``'s numerics: ``x`` [..., D] -> uint8
    [..., D + 2] (the values, then the float16 scale)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    out = torch.empty(flat.shape[0], flat.shape[1] + 2, dtype=torch.uint8)
    for i, row in enumerate(flat):
        amax = max(abs(float(v)) for v in row.tolist())
        scale = torch.tensor(max(amax / fmt.qmax, 2.0**-24), dtype=torch.float32)
        scale16 = scale.to(torch.float16)
        scaled = row / scale16.float()
        if fmt.value_dtype is torch.int8:
            values = torch.round(scaled).clamp(-fmt.qmax, fmt.qmax).to(torch.int8)
        else:
            values = scaled.clamp(-fmt.qmax, fmt.qmax).to(fmt.value_dtype)
        out[i, :-2] = values.view(torch.uint8)
        out[i, -2:] = scale16.reshape(1).view(torch.uint8)
    return out.reshape(*x.shape[:-1], x.shape[-1] + 2)


def dequantize_kv_ref(rows: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Quantized rows [..., D + 2] back to float64 [..., D]: value times scale."""
    values = rows[..., :-2].contiguous().view(fmt.value_dtype).double()
    scale = rows[..., -2:].contiguous().view(torch.float16).double()
    return values * scale


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
) -> None:
    """Write each token's K/V into its cache slot. Slots < 0 are skipped (padding). With an
    8-bit ``kv_cache_dtype`` each row is quantized (``quantize_kv_ref``) on the way."""
    block_size = k_cache.shape[1]
    fmt = FORMATS[kv_cache_dtype]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k, v = key[i], value[i]
        if fmt.quantized:
            k, v = quantize_kv_ref(k, fmt), quantize_kv_ref(v, fmt)
        k_cache[slot // block_size, slot % block_size] = k
        v_cache[slot // block_size, slot % block_size] = v


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """Causal attention of a ragged batch of queries over the paged cache. Returns [N, Hq, D].
    With an 8-bit ``kv_cache_dtype`` the keys and values are the cache's rows read back
    (``dequantize_kv_ref``)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    fmt = FORMATS[kv_cache_dtype]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    for s, ctx_len in enumerate(seq_lens.tolist()):
        q = query[qsl[s] : qsl[s + 1]].double()  # [q_len, Hq, D]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        num_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[s, :num_blocks].long()
        width = k_cache.shape[-1]
        k = k_cache[blocks].reshape(-1, num_kv_heads, width)[:ctx_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, width)[:ctx_len]
        if fmt.quantized:
            k, v = dequantize_kv_ref(k, fmt), dequantize_kv_ref(v, fmt)
        k, v = k.double(), v.double()
        k = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] > q_pos[:, None]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[qsl[s] : qsl[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (when given), then RMSNorm of it.

    Returns ``(normed, new_residual)``; without a residual, ``new_residual`` is ``x``.
    """
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.double()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.double()).to(x.dtype), x


def rotary_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (rotate the two halves of each head).

    ``cos_sin_cache`` is [max_positions, head_dim] holding ``cat(cos, sin)`` of the
    ``head_dim // 2`` frequencies. query [N, Hq, D], key [N, Hkv, D]. Returns new tensors.
    """
    half = query.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].double()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].double(), x[..., half:].double()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def matmul_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` in float64, the yardstick for every linear kernel."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
