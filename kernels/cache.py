"""Writing new tokens' K/V into the paged cache through a slot mapping (torch CPU path).

The CPU cache is head-major, ``[num_kv_heads, num_blocks, block_size, head_dim]``
(``kernels/attention.py`` says why). A slot < 0 is padding and is skipped, as in
``store_kv_ref`` and the Triton kernel: indexing with it would write the cache's last slot.
With an 8-bit KV format (``kernels/kv_quant.py``) each row is quantized on the way in and
the cache's last dimension is ``head_dim + 2``.
"""

from __future__ import annotations

import torch

from kernels.kv_quant import FORMATS, KVFormat, quantize_rows


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: KVFormat = FORMATS["auto"],
) -> None:
    """Write each new token's K/V ([N, Hkv, D]) into its slot (``block * block_size + offset``),
    quantized when ``fmt`` is an 8-bit format; slots < 0 are skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if fmt.quantized:
        key, value = quantize_rows(key, fmt), quantize_rows(value, fmt)
    num_kv_heads, width = k_cache.shape[0], k_cache.shape[3]
    k_cache.view(num_kv_heads, -1, width)[:, slot_mapping] = key.transpose(0, 1)
    v_cache.view(num_kv_heads, -1, width)[:, slot_mapping] = value.transpose(0, 1)
