"""Rotary position embedding (neox style) and its cos/sin table, Llama 3 scaling included.

The table is ``[max_positions, head_dim]`` holding ``cat(cos, sin)`` of the ``head_dim // 2``
frequencies, the layout ``kernels/reference.py`` and the Triton kernel share.
"""

from __future__ import annotations

import math

import torch

_SUPPORTED_SCALING = ("default", "llama3", "linear")


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind not in _SUPPORTED_SCALING:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported "
            f"(supported: {', '.join(_SUPPORTED_SCALING)})"
        )
    if kind == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif kind == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(rope_scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq


def build_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    inv_freq = inverse_frequencies(head_dim, theta, rope_scaling).float()
    # float32 angles, as transformers computes them, so greedy outputs match it token for token.
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [N, Hq, D], key [N, Hkv, D] -> rotated copies."""
    half = query.shape[-1] // 2
    cs = cos_sin_cache[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(query), rotate(key)
