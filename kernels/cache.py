"""Writing new tokens' K/V into the paged cache through a slot mapping (torch path)."""

from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's K/V into its slot (``block * block_size + offset``)."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = key
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = value
