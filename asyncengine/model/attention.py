"""asyncengine's paged attention, plugged into transformers' attention interface.

The model runner passes an `AttentionMetadata` to the model's forward as the keyword argument
`asyncengine_attn`; transformers hands every keyword argument on to the attention function of
each layer, which writes the layer's new K/V into the paged cache and attends over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.kernels.paged_attention import (
    TorchAttentionPlan,
    paged_attention_torch,
    plan_paged_attention_torch,
)
from asyncengine.kernels.reshape_and_cache import reshape_and_cache_torch

ATTN_IMPLEMENTATION = "asyncengine_paged"


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged cache, for every layer alike."""

    kv_caches: list[torch.Tensor]  # per layer [2, H_kv, num_blocks, block_size, D]
    slot_mapping: torch.Tensor  # [T] int64
    plan: TorchAttentionPlan  # the batch layout, planned once per step for every layer

    @classmethod
    def build(
        cls,
        kv_caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,  # [T]
        query_start_loc: list[int],  # B + 1 offsets into the packed tokens
        seq_lens: list[int],  # [B] tokens in the cache after this step
        block_table: torch.Tensor,  # [B, max_blocks]
        block_size: int,
        dtype: torch.dtype,
    ) -> AttentionMetadata:
        plan = plan_paged_attention_torch(query_start_loc, seq_lens, block_table, block_size, dtype)
        return cls(kv_caches=kv_caches, slot_mapping=slot_mapping, plan=plan)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H_q, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: returns ([1, T, H_q, D], no weights)."""
    meta: AttentionMetadata = kwargs["asyncengine_attn"]
    kv_cache = meta.kv_caches[module.layer_idx]  # type: ignore[index]
    q = query[0].transpose(0, 1)  # [T, H_q, D]
    k = key[0].transpose(0, 1)  # [T, H_kv, D]
    v = value[0].transpose(0, 1)
    reshape_and_cache_torch(k, v, kv_cache, meta.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = paged_attention_torch(q, k, v, kv_cache, meta.plan, scale)  # [T, H_q, D]
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # Causality comes from the packed metadata; a dense [T, T] mask would be wasted work.
    return None


def register() -> None:
    """Register the attention function and its (absent) mask under ATTN_IMPLEMENTATION."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
