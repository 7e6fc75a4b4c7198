"""Writing new tokens' K/V into the paged cache through a slot mapping, in Triton.

The Triton twin of ``store_kv_ref`` in ``kernels/reference.py``: token ``i`` goes to block
``slot_mapping[i] // block_size``, offset ``slot_mapping[i] % block_size``; a slot < 0 is
padding and is skipped. One program per token copies its ``[Hkv, D]`` rows of K and V; a
copy has no reduction, so the result never depends on the batch.

8-bit caches (``kv_cache_dtype`` ``int8`` or ``fp8_e4m3``, ``kernels/kv_quant.py``)
    The caches are uint8 ``[num_blocks, block_size, Hkv, D + 2]``; each row is quantized on
    the way in, exactly as ``kv_quant.quantize_rows`` does it (float32 math, the max over
    the row, the scale rounded to float16, ``x / scale`` as an IEEE division), and written
    as its ``D`` value bytes then the scale's 2 bytes. A row's bytes depend on that row
    alone, so the store stays batch-invariant. The roundings are spelled out in bit
    operations rather than left to casts, because the casts do not round the same way
    everywhere: int8 rounds half to even by ``floor`` and a comparison (libdevice's ``rint``
    does not run under the interpreter), and float8_e4m3fn is encoded by the algorithm
    of c10's ``fp8e4m3fn_from_fp32_value`` (the interpreter's float8 cast does not round
    to nearest even; sm_80 has no e4m3 conversion instruction). The divisions are
    ``div_rn``: a plain ``/`` compiles to an approximate division on NVIDIA GPUs. There
    Triton flushes subnormals in the divisions and the floor (``div.rn.ftz``,
    ``cvt.rmi.ftz``); no byte changes, since a quotient that small is a zero code either
    way (its sign kept, as torch keeps it), and a subnormal row max gives ``MIN_SCALE``
    either way.
    ``fp8e4m3_to_float`` is the exact way back, shared with ``kernels/triton_attention.py``.
    Bit-exact with ``quantize_rows`` for finite inputs; a row holding NaN or inf gets
    unspecified bytes.

How it fails: ``ValueError`` naming the argument for a wrong shape, dtype or device, an
unknown ``kv_cache_dtype``, or an 8-bit cache whose rows would leave the float16 scale
misaligned (odd ``head_dim``, odd strides or address). Slots are not bounds-checked on the
device (that would cost a host sync per step); the engine's block pool only hands out
slots inside the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import MIN_SCALE, SCALE_BYTES, kv_format
from kernels.triton_common import FLOAT_DTYPES, check_tensor, patch_interpreter

patch_interpreter()

NUM_WARPS = 4
"""Warps per token: a copy of Hkv * D elements (2-8 KiB in half precision) is bandwidth-bound."""
KV_QUANT_CODES = {"auto": 0, "int8": 1, "fp8_e4m3": 2}
"""The kernels' ``KV_QUANT`` constexpr for each ``kv_cache_dtype``."""


def check_scale_alignment(name: str, cache: torch.Tensor) -> None:
    """Every row's float16 scale must be 2-byte aligned: even address and strides."""
    if cache.data_ptr() % 2 or any(s % 2 for s in cache.stride()[:-1]):
        raise ValueError(
            f"{name} must have an even address and even strides (its rows end with a "
            f"2-byte float16 scale), got strides {tuple(cache.stride())}"
        )


@triton.jit
def fp8e4m3_to_float(bits):
    """float8_e4m3fn bit patterns (uint8) as float32, exactly; 0x7F / 0xFF are NaN."""
    b = bits.to(tl.uint32)
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # rebias 7 -> 127
    subnormal = mag.to(tl.float32) * 0.001953125  # exponent field 0: mantissa * 2**-9
    x = tl.where(mag < 8, subnormal, normal)
    x = tl.where(mag == 0x7F, float("nan"), x)
    return tl.where(b >= 0x80, -x, x)


@triton.jit
def _float_to_fp8e4m3(x):
    """float32 -> float8_e4m3fn bits (uint8), round to nearest even: the algorithm of c10's
    ``fp8e4m3fn_from_fp32_value`` (what torch's cast runs), bit for bit; >= 464 is NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits >> 31
    mag = bits & 0x7FFFFFFF
    # Below 2**-6 (the smallest normal): adding 2**14 rounds |x| to a multiple of 2**-9 (the
    # subnormal step) in the float unit, and the low bits are the code.
    denorm = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True)
    denorm = denorm - (141 << 23)
    # Normal: rebias the exponent, round the 20 dropped mantissa bits to nearest even.
    normal = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    code = tl.where(mag < (121 << 23), denorm, normal)
    code = tl.where(mag >= (1087 << 20), 0x7F, code)
    return ((code & 0x7F) | (sign << 7)).to(tl.uint8)


@triton.jit
def _round_to_int8(x):
    """float32 in [-127, 127] rounded half to even, as int8 bits (uint8)."""
    low = tl.floor(x)
    frac = x - low  # exact, but for x in (-0.5, 0): 0.5 or 1.0, and x still goes to 0
    q = low.to(tl.int32)
    up = (frac > 0.5) | ((frac == 0.5) & ((q & 1) == 1))
    return ((q + up.to(tl.int32)) & 0xFF).to(tl.uint8)


@triton.jit
def _quantize_rows(x, KV_QUANT: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Rows ``x`` [H, D] (float32; padding lanes 0) -> (value bytes [H, D], scales [H] fp16),
    ``kv_quant.quantize_rows``'s numerics."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, QMAX), MIN_SCALE).to(tl.float16)
    scaled = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
    if KV_QUANT == 1:
        values = _round_to_int8(scaled)
    else:
        values = _float_to_fp8e4m3(scaled)
    return values, scale


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    KV_QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    ok = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kt + heads * stride_kh + dims, mask=ok, other=0.0)
    v = tl.load(value_ptr + src * stride_vt + heads * stride_vh + dims, mask=ok, other=0.0)
    k_row = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch
    v_row = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch
    if KV_QUANT == 0:
        tl.store(k_row + dims, k, mask=ok)
        tl.store(v_row + dims, v, mask=ok)
    else:
        k_values, k_scale = _quantize_rows(k.to(tl.float32), KV_QUANT, QMAX, MIN_SCALE)
        v_values, v_scale = _quantize_rows(v.to(tl.float32), KV_QUANT, QMAX, MIN_SCALE)
        tl.store(k_row + dims, k_values, mask=ok)
        tl.store(v_row + dims, v_values, mask=ok)
        head_ok = heads < NUM_KV_HEADS
        k_scale_ptr = (k_row + HEAD_DIM).to(tl.pointer_type(tl.float16))
        v_scale_ptr = (v_row + HEAD_DIM).to(tl.pointer_type(tl.float16))
        tl.store(k_scale_ptr, k_scale[:, None], mask=head_ok)
        tl.store(v_scale_ptr, v_scale[:, None], mask=head_ok)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
) -> None:
    """Write ``key``/``value`` ``[N, Hkv, D]`` into the caches at ``slot_mapping`` (< 0: skip).

    With an 8-bit ``kv_cache_dtype`` the caches are uint8 ``[..., Hkv, D + 2]`` and each row
    is quantized on the way (``kernels/kv_quant.py``); ``auto`` copies in the cache's dtype.
    """
    fmt = kv_format(kv_cache_dtype)
    cache_dtypes = (torch.uint8,) if fmt.quantized else FLOAT_DTYPES
    check_tensor("k_cache", k_cache, ndim=4, dtypes=cache_dtypes)
    _, block_size, num_kv_heads, width = k_cache.shape
    head_dim = width - SCALE_BYTES if fmt.quantized else width
    if fmt.quantized:
        if head_dim < 2:
            raise ValueError(f"k_cache rows of {width} bytes hold no {fmt.name} values")
        kv_format(kv_cache_dtype, head_dim)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape))
    key_dtypes = FLOAT_DTYPES if fmt.quantized else (k_cache.dtype,)
    check_tensor("key", key, ndim=3, dtypes=key_dtypes, shape=(None, num_kv_heads, head_dim))
    num_tokens = key.shape[0]
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), shape=tuple(key.shape))
    check_tensor(
        "slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), shape=(num_tokens,)
    )
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if fmt.quantized:
        check_scale_alignment("k_cache", k_cache)
        check_scale_alignment("v_cache", v_cache)
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        KV_QUANT=KV_QUANT_CODES[fmt.name],
        QMAX=fmt.qmax,
        MIN_SCALE=MIN_SCALE,
        num_warps=NUM_WARPS,
    )
