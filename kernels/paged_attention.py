"""Paged attention over a packed varlen batch: the torch reference backend.

Each sequence i contributes `q_len_i = query_start_loc[i+1] - query_start_loc[i]` query tokens,
the last `q_len_i` of its `seq_lens[i]` tokens (the earlier ones are an already-cached prefix).
Attention is causal; K/V come from the paged cache through `block_table`.

The work that is the same for every layer (which rows decode, block ids to gather, masks) is
planned once per step by `plan_paged_attention_torch`; `paged_attention_torch` then runs it
for one layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class _Prefill:
    start: int  # packed token range [start, end)
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [nb] blocks to read; None: no cached prefix, use new K/V
    mask: torch.Tensor | None  # [q_len, seq_len] additive causal mask with a prefix offset


@dataclass(slots=True)
class TorchAttentionPlan:
    """One step's attention layout, shared by every layer."""

    decode_token_idx: torch.Tensor | None  # [Bd] packed positions of single-token queries
    decode_block_ids: torch.Tensor | None  # [Bd * nb] their blocks, row-major
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, nb * block_size] additive padding mask
    prefills: list[_Prefill]


def plan_paged_attention_torch(
    query_start_loc: list[int],  # B + 1 offsets into the packed tokens
    seq_lens: list[int],  # [B] context length including this step's tokens
    block_table: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    dtype: torch.dtype,
) -> TorchAttentionPlan:
    device = block_table.device
    decode_rows = [
        i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] == 1
    ]
    prefills: list[_Prefill] = []
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        if q_len <= 1:
            continue
        if seq_len == q_len:
            prefills.append(_Prefill(start, end, seq_len, None, None))
            continue
        nb = -(-seq_len // block_size)
        # Query j sits at position seq_len - q_len + j and sees keys up to it.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        visible = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible, float("-inf"))
        prefills.append(_Prefill(start, end, seq_len, block_table[i, :nb], mask))
    if not decode_rows:
        return TorchAttentionPlan(None, None, None, prefills)
    rows = torch.tensor(decode_rows, device=device)
    lens = torch.tensor([seq_lens[i] for i in decode_rows], device=device)  # [Bd]
    nb = -(-max(seq_lens[i] for i in decode_rows) // block_size)
    pad = torch.arange(nb * block_size, device=device)[None, :] >= lens[:, None]  # [Bd, L]
    mask = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill_(pad, float("-inf"))
    return TorchAttentionPlan(
        decode_token_idx=torch.tensor([query_start_loc[i] for i in decode_rows], device=device),
        decode_block_ids=block_table[rows, :nb].reshape(-1),
        decode_mask=mask[:, None, None, :],
        prefills=prefills,
    )


def paged_attention_torch(
    query: torch.Tensor,  # [T, H_q, D]
    key: torch.Tensor,  # [T, H_kv, D] this step's keys (also written to the cache)
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, D]
    plan: TorchAttentionPlan,
    scale: float,
) -> torch.Tensor:  # [T, H_q, D]
    """Torch reference: decodes in one batched call, prefill chunks one sequence at a time."""
    output = torch.empty_like(query)
    num_blocks, _block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    # index_select over flat blocks is several times faster than advanced indexing on CPU.
    flat_cache = kv_cache.view(2, num_blocks, -1)  # [2, num_blocks, bs * H_kv * D]
    if plan.decode_token_idx is not None:
        _decode(query, flat_cache, plan, scale, output, num_kv_heads, head_dim)
    gqa = query.shape[1] != num_kv_heads
    for p in plan.prefills:
        q = query[p.start : p.end].transpose(0, 1)  # [H_q, q_len, D]
        if p.block_ids is None:
            k = key[p.start : p.end].transpose(0, 1)  # [H_kv, S, D]
            v = value[p.start : p.end].transpose(0, 1)
        else:
            kv = flat_cache.index_select(1, p.block_ids)  # [2, nb, bs * H_kv * D]
            kv = kv.view(2, -1, num_kv_heads, head_dim)[:, : p.seq_len]  # [2, S, H_kv, D]
            k, v = kv[0].transpose(0, 1).to(q.dtype), kv[1].transpose(0, 1).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=gqa
        )  # [H_q, q_len, D]
        output[p.start : p.end] = o.transpose(0, 1)
    return output


def _decode(
    query: torch.Tensor,
    flat_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
    output: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    assert plan.decode_block_ids is not None and plan.decode_token_idx is not None
    bd = plan.decode_token_idx.numel()
    num_q_heads = query.shape[1]
    kv = flat_cache.index_select(1, plan.decode_block_ids)  # [2, Bd * nb, bs * H_kv * D]
    kv = kv.view(2, bd, -1, num_kv_heads, head_dim)  # [2, Bd, L, H_kv, D]
    k = kv[0].transpose(1, 2).to(query.dtype)  # [Bd, H_kv, L, D]
    v = kv[1].transpose(1, 2).to(query.dtype)
    # Each KV head's G query heads act as G query positions of one sequence: no K/V repeat.
    q = query[plan.decode_token_idx].view(bd, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale)
    output[plan.decode_token_idx] = o.reshape(bd, num_q_heads, head_dim)  # [Bd, H_q, D]
