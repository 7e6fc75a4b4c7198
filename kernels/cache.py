"""Writing new tokens' K/V into the paged cache through a slot mapping (torch CPU path).

The CPU cache is head-major, ``[num_kv_heads, num_blocks, block_size, head_dim]``
(``kernels/attention.py`` says why). A slot < 0 is padding and is skipped, as in
``store_kv_ref`` and the Triton kernel: indexing with it would write the cache's last slot.
"""

from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's K/V ([N, Hkv, D]) into its slot (``block * block_size + offset``);
    slots < 0 are skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k_cache.view(num_kv_heads, -1, head_dim)[:, slot_mapping] = key.transpose(0, 1)
    v_cache.view(num_kv_heads, -1, head_dim)[:, slot_mapping] = value.transpose(0, 1)
