"""8-bit KV cache rows: what a quantized K or V row is, how it is made and read back.

``--kv-cache-dtype`` (``EngineConfig.kv_cache_dtype``) picks the format: ``auto`` keeps K/V
in the model's dtype; ``int8`` and ``fp8_e4m3`` store each token's K (or V) row of one KV
head as ``head_dim`` 8-bit values followed by that row's scale, a float16 in 2 bytes. The
cache of an 8-bit format is then a ``uint8`` tensor whose last dimension is ``head_dim + 2``
(``row_bytes``), laid out like the full-precision cache otherwise, so every copy of blocks
(host tier, export and import, shared-memory pulls) moves it unchanged.

The numerics, which every implementation follows (``kernels/reference.py`` has the slow
twin the tests hold the fast paths to):
    scale  = float16(max(|x|) / QMAX), at least ``MIN_SCALE``  (x: the row, in float32)
    int8:     q = clamp(round_half_even(x / scale), -127, 127)
    fp8_e4m3: q = float8_e4m3fn(clamp(x / scale, -448, 448))   (round to nearest even)
    read back: float32(q) * float32(scale), then the query's dtype.
A row's bytes depend on that row alone: never on the batch, the chunking, the other
requests of the step or the replica, so the determinism contract holds by construction.
A float16 scale keeps 10 bits down to rows of max magnitude ~1e-2 and fewer below; a row
under ~1e-4 (far below what attention can tell from zero) is stored coarsely.

How it fails: ``kv_format`` raises ``ValueError`` for a name it does not know and for a
head size the scale cannot follow aligned (odd ``head_dim``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import KV_CACHE_DTYPES  # noqa: E402 - the names live where no torch is needed

"""The values ``--kv-cache-dtype`` takes (vLLM's flag name)."""
SCALE_BYTES = 2
"""Each quantized row ends with its scale, a float16."""
MIN_SCALE = 2.0**-24
"""The smallest scale stored (float16's smallest subnormal): an all-zero row quantizes to
zeros instead of dividing by zero."""


@dataclass(frozen=True)
class KVFormat:
    """How one KV cache stores its rows."""

    name: str
    """One of ``KV_CACHE_DTYPES``."""
    qmax: float = 0.0
    """The largest magnitude of a quantized value (127 for int8, 448 for fp8_e4m3)."""
    value_dtype: torch.dtype | None = None
    """The dtype the 8-bit values are read as (None: not quantized)."""

    @property
    def quantized(self) -> bool:
        return self.value_dtype is not None

    def row_bytes(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes of one token's K (or V) row of one KV head."""
        if not self.quantized:
            return head_dim * torch.empty((), dtype=model_dtype).element_size()
        return head_dim + SCALE_BYTES

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the cache tensor: the model's, or bytes."""
        return torch.uint8 if self.quantized else model_dtype

    def row_width(self, head_dim: int) -> int:
        """The cache's last dimension: ``head_dim``, or the 8-bit values and the scale."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim


FORMATS = {
    "auto": KVFormat("auto"),
    "int8": KVFormat("int8", 127.0, torch.int8),
    "fp8_e4m3": KVFormat("fp8_e4m3", 448.0, torch.float8_e4m3fn),
}


def kv_format(name: str, head_dim: int | None = None) -> KVFormat:
    """The format ``--kv-cache-dtype name`` stands for; checks ``head_dim`` when given."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    if fmt.quantized and head_dim is not None and head_dim % 2:
        raise ValueError(
            f"kv_cache_dtype={name} needs an even head_dim (the scale is a 2-byte float "
            f"after the values), got {head_dim}"
        )
    return fmt


def quantize_rows(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``x`` [..., head_dim] (any float dtype) as quantized rows [..., head_dim + 2] uint8."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / fmt.qmax).clamp_min(MIN_SCALE).to(torch.float16)
    scaled = xf / scale.float()
    if fmt.value_dtype is torch.int8:
        values = torch.round(scaled).clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:
        values = scaled.clamp_(-fmt.qmax, fmt.qmax).to(fmt.value_dtype)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_rows(
    rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantized rows [..., head_dim + 2] uint8 read back as [..., head_dim] of ``dtype``;
    ``out`` (contiguous, that shape and dtype) receives them when given."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
    if dtype != torch.float32:
        values = rows[..., :head_dim].view(fmt.value_dtype).float()
        result = (values * scale).to(dtype)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(rows.shape[:-1] + (head_dim,), dtype=torch.float32, device=rows.device)
    values = rows[..., :head_dim]
    if fmt.value_dtype is torch.int8:  # converting while copying: no temporary
        out.copy_(values.view(torch.int8))
    else:  # a 256-entry table beats torch's float8 conversion on CPUs several times over
        codes = values.reshape(-1).to(torch.int32)
        torch.index_select(_fp8_values(rows.device), 0, codes, out=out.view(-1))
    return out.mul_(scale)  # float32(value) * float32(scale), as the numerics above say


@functools.cache
def _fp8_values(device: torch.device) -> torch.Tensor:
    """Every float8_e4m3fn bit pattern's value as float32, by pattern."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).float().to(device)
