"""reshape_and_cache: write the new tokens' K/V into the paged cache at `slot_mapping`.

Cache layout (one tensor per layer): `[2, num_kv_heads, num_blocks, block_size, head_dim]`;
index 0 holds keys, 1 values. Slot `s` is block `s // block_size`, offset `s % block_size`.
Heads outermost means that gathering a sequence's blocks for one head yields `[S, D]` rows
that attention reads as they are, with no transposing copy.
"""

from __future__ import annotations

import torch


def reshape_and_cache_torch(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Torch reference: scatter K/V rows into their cache slots, in place."""
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
    flat = kv_cache.view(2, num_kv_heads, -1, head_dim)  # [2, H_kv, num_slots, D]
    flat[0].index_copy_(1, slot_mapping, key.transpose(0, 1).to(kv_cache.dtype))
    flat[1].index_copy_(1, slot_mapping, value.transpose(0, 1).to(kv_cache.dtype))
