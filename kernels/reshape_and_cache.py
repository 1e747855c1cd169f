"""reshape_and_cache: write the new tokens' K/V into the paged cache at `slot_mapping`.

Cache layout (one tensor per layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`;
index 0 holds keys, 1 values. Slot `s` is block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

import torch


def reshape_and_cache_torch(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Torch reference: scatter K/V rows into their cache slots, in place."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, H_kv, D]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
