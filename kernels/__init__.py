"""Attention, KV-cache, norm, rotary and matmul kernels: torch on CPU, Triton on CUDA.

Every kernel has a slow torch twin in ``kernels/reference.py`` that tests compare against.
Depends on torch (and triton, when present) only.
"""
