"""The Triton kernels behind one facade with the signatures of ``kernels/reference.py``.

The model calls ``store_kv``, ``paged_attention``, ``rms_norm``, ``rotary`` and ``matmul`` from
here when it runs on CUDA; each takes exactly the arguments of its twin ``*_ref`` in
``kernels/reference.py`` and returns the same thing. The kernel modules (``triton_*.py``) are
imported on first use, so importing this module never needs triton: ``triton_available()``
says whether the kernels can run at all.

Where the kernels run
    On a CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set
    before the kernel modules are imported), which is how the tests run without a GPU. The
    argument checks and the interpreter's fixes (``patch_interpreter``) live in
    ``kernels/triton_common.py``, which the kernel modules (and anyone else) import them
    from, not from this facade.

How it fails
    Without triton, or without CUDA and without the interpreter, every op raises
    ``RuntimeError`` saying so; nothing falls back silently to another implementation.
"""

from __future__ import annotations

import importlib.util

import torch

from kernels.triton_common import interpreting

__all__ = [
    "store_kv",
    "paged_attention",
    "rms_norm",
    "rotary",
    "matmul",
    "triton_available",
]


def triton_available() -> bool:
    """Whether the Triton kernels can run here: triton installed, and CUDA or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or interpreting()


def _require_triton() -> None:
    if not triton_available():
        raise RuntimeError(
            "Triton kernels need triton and a CUDA device (or TRITON_INTERPRET=1 set before "
            "triton is imported, for the CPU interpreter); use the torch kernels instead"
        )


def store_kv(key, value, k_cache, v_cache, slot_mapping, kv_cache_dtype="auto") -> None:
    """Triton twin of ``store_kv_ref``: write each token's K/V to its slot, skip slots < 0;
    an 8-bit ``kv_cache_dtype`` (``kernels/kv_quant.py``) quantizes each row on the way."""
    _require_triton()
    from kernels.triton_cache import store_kv as kernel

    kernel(key, value, k_cache, v_cache, slot_mapping, kv_cache_dtype)


def paged_attention(
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, kv_cache_dtype="auto"
):
    """Triton twin of ``paged_attention_ref``: causal attention of a ragged batch, [N, Hq, D];
    an 8-bit ``kv_cache_dtype`` reads the caches' quantized rows back."""
    _require_triton()
    from kernels.triton_attention import paged_attention as kernel

    return kernel(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, kv_cache_dtype
    )


def rms_norm(x, weight, eps, residual=None):
    """Triton twin of ``rms_norm_ref``: returns ``(normed, new_residual)``."""
    _require_triton()
    from kernels.triton_norm import rms_norm as kernel

    return kernel(x, weight, eps, residual)


def rotary(query, key, positions, cos_sin_cache):
    """Triton twin of ``rotary_ref``: neox-style rotation, returns new (query, key)."""
    _require_triton()
    from kernels.triton_rotary import rotary as kernel

    return kernel(query, key, positions, cos_sin_cache)


def matmul(x, weight, bias=None):
    """Triton twin of ``matmul_ref``: batch-invariant ``x @ weight.T + bias``."""
    _require_triton()
    from kernels.triton_matmul import bi_matmul

    return bi_matmul(x, weight, bias)
