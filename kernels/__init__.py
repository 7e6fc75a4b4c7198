"""Attention, KV-cache, norm, rotary and matmul kernels: torch on CPU, Triton on CUDA.

Every kernel has a slow torch twin in ``kernels/reference.py`` that tests compare against.
Depends on torch (and triton, when present) only.
"""

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
"""The KV cache formats (``kernels/kv_quant.py``), here so that checking a configuration's
name needs no torch."""
