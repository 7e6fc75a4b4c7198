"""The one switch between kernel implementations: ``select_backend(name, deterministic)``.

- ``torch``: the CPU path (``kernels/attention.py``, ``linear.py``, ``norm.py``, ``rotary.py``,
  ``cache.py``); batch-invariant when ``deterministic``.
- ``triton``: the Triton kernels behind ``kernels/triton_ops.py``; linear layers go through
  the batch-invariant Triton matmul when ``deterministic``, else through torch (cuBLAS).
- ``auto``: ``triton`` on CUDA, ``torch`` elsewhere.

``kv_cache_dtype`` (``kernels/kv_quant.py``) makes both store and read an 8-bit cache.

Both satisfy the determinism contract of docs/design.md on their own; outputs of the two may
differ from each other in the last bits (a deployment runs one backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import attention as torch_attention
from kernels.cache import store_kv as torch_store_kv
from kernels.kv_quant import KVFormat, kv_format
from kernels.linear import batch_invariant_linear, fast_linear, pack_weight, plain_linear
from kernels.norm import rms_norm as torch_rms_norm
from kernels.rotary import apply_rotary

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelBackend:
    name: str
    linear: Callable
    rms_norm: Callable
    rotary: Callable
    store_kv: Callable
    attention: Callable
    """attention(query, k_cache, v_cache, meta: AttentionMetadata, scale) -> [N, Hq, D]"""
    head_major_cache: bool
    """Cache layout: ``[Hkv, blocks, block_size, D]`` (torch CPU) or ``[blocks, block_size,
    Hkv, D]`` (Triton, ``kernels/reference.py``)."""
    prepare_weight: Callable = lambda weight: weight
    """Called once per linear weight at load; returns what ``linear`` takes (``pack_weight``
    on the batch-invariant torch path, the weight itself elsewhere)."""
    kv_format: KVFormat = kv_format("auto")
    """How the KV cache stores its rows: the model's dtype or an 8-bit format."""


def select_backend(
    name: str, deterministic: bool, device: str, kv_cache_dtype: str = "auto"
) -> KernelBackend:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    fmt = kv_format(kv_cache_dtype)
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name == "torch":
        return KernelBackend(
            name="torch",
            linear=batch_invariant_linear if deterministic else fast_linear,
            rms_norm=torch_rms_norm,
            rotary=apply_rotary,
            store_kv=lambda k, v, kc, vc, slots: torch_store_kv(k, v, kc, vc, slots, fmt),
            attention=lambda q, kc, vc, meta, scale: torch_attention.paged_attention(
                q, kc, vc, meta, scale, deterministic, fmt
            ),
            head_major_cache=True,
            prepare_weight=pack_weight,
            kv_format=fmt,
        )
    from kernels import triton_ops
    from kernels.triton_common import patch_interpreter

    if not triton_ops.triton_available():
        raise ValueError(
            "kernel backend 'triton' needs the triton package and a CUDA device "
            "(or TRITON_INTERPRET=1)"
        )
    patch_interpreter()

    def attention(q: torch.Tensor, kc, vc, meta, scale: float) -> torch.Tensor:
        return triton_ops.paged_attention(
            q.contiguous(),
            kc,
            vc,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            kv_cache_dtype=fmt.name,
        )

    def rotary(
        q: torch.Tensor, k: torch.Tensor, positions, cos_sin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_ops.rotary(q.contiguous(), k.contiguous(), positions, cos_sin)

    def store_kv(k: torch.Tensor, v: torch.Tensor, kc, vc, slots) -> None:
        triton_ops.store_kv(k.contiguous(), v.contiguous(), kc, vc, slots, kv_cache_dtype=fmt.name)

    return KernelBackend(
        name="triton",
        linear=triton_ops.matmul if deterministic else plain_linear,
        rms_norm=triton_ops.rms_norm,
        rotary=rotary,
        store_kv=store_kv,
        attention=attention,
        head_major_cache=False,
        kv_format=fmt,
    )
