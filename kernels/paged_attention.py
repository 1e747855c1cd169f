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
    decode_mask: torch.Tensor | None  # [Bd, 1, L] fp32 additive padding mask, L = nb * bs
    prefills: list[_Prefill]


def plan_prefills(
    query_start_loc: list[int],  # B + 1 offsets into the packed tokens
    seq_lens: list[int],  # [B] context length including this step's tokens
    block_table: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    dtype: torch.dtype,
    min_query_len: int = 2,
) -> list[_Prefill]:
    """The sequences with at least `min_query_len` query tokens, with what attending them needs."""
    device = block_table.device
    prefills: list[_Prefill] = []
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        if q_len < min_query_len:
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
    return prefills


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
    prefills = plan_prefills(query_start_loc, seq_lens, block_table, block_size, dtype)
    if not decode_rows:
        return TorchAttentionPlan(None, None, None, prefills)
    rows = torch.tensor(decode_rows, device=device)
    lens = torch.tensor([seq_lens[i] for i in decode_rows], device=device)  # [Bd]
    nb = -(-max(seq_lens[i] for i in decode_rows) // block_size)
    pad = torch.arange(nb * block_size, device=device)[None, :] >= lens[:, None]  # [Bd, L]
    mask = torch.zeros(pad.shape, device=device).masked_fill_(pad, float("-inf"))  # fp32
    return TorchAttentionPlan(
        decode_token_idx=torch.tensor([query_start_loc[i] for i in decode_rows], device=device),
        decode_block_ids=block_table[rows, :nb].reshape(-1),
        decode_mask=mask[:, None, :],
        prefills=prefills,
    )


def paged_attention_torch(
    query: torch.Tensor,  # [T, H_q, D]
    key: torch.Tensor,  # [T, H_kv, D] this step's keys (also written to the cache)
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D]
    plan: TorchAttentionPlan,
    scale: float,
) -> torch.Tensor:  # [T, H_q, D]
    """Torch reference: decodes in one batched call, prefill chunks one sequence at a time."""
    output = torch.empty_like(query)
    num_kv_heads, num_blocks, _block_size, head_dim = kv_cache.shape[1:]
    # index_select over flat blocks is several times faster than advanced indexing on CPU.
    flat_cache = kv_cache.view(2, num_kv_heads, num_blocks, -1)  # [2, H_kv, nblk, bs * D]
    if plan.decode_token_idx is not None:
        _decode(query, flat_cache, plan, scale, output, num_kv_heads, head_dim)
    attend_prefills(query, key, value, kv_cache, plan.prefills, scale, output)
    return output


def attend_prefills(
    query: torch.Tensor,  # [T, H_q, D]
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D]
    prefills: list[_Prefill],
    scale: float,
    output: torch.Tensor,  # [T, H_q, D], written at the prefills' rows
    keys_transposed: bool = False,  # key blocks stored [D, block_size] (the "cpu" backend)
) -> None:
    """Causal SDPA for each prefill chunk, over its new K/V or its gathered cached blocks."""
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    flat_cache = kv_cache.view(2, num_kv_heads, num_blocks, -1)  # [2, H_kv, nblk, bs * D]
    gqa = query.shape[1] != num_kv_heads
    for p in prefills:
        q = query[p.start : p.end].transpose(0, 1)  # [H_q, q_len, D]
        if p.block_ids is None:
            k = key[p.start : p.end].transpose(0, 1)  # [H_kv, S, D]
            v = value[p.start : p.end].transpose(0, 1)
        else:
            kv = flat_cache.index_select(2, p.block_ids)  # [2, H_kv, nb, bs * D]
            v = kv[1].view(num_kv_heads, -1, head_dim)[:, : p.seq_len]  # [H_kv, S, D]
            if keys_transposed:
                k = kv[0].view(num_kv_heads, -1, head_dim, block_size).transpose(-1, -2)
                k = k.reshape(num_kv_heads, -1, head_dim)[:, : p.seq_len]
            else:
                k = kv[0].view(num_kv_heads, -1, head_dim)[:, : p.seq_len]
            k, v = k.to(q.dtype), v.to(q.dtype)
        # 4-D inputs: CPU SDPA takes its flash kernel for them, but its slow generic path
        # for 3-D ones (about twice the time).
        o = F.scaled_dot_product_attention(
            q[None],
            k[None],
            v[None],
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )  # [1, H_q, q_len, D]
        output[p.start : p.end] = o[0].transpose(0, 1)


def _decode(
    query: torch.Tensor,
    flat_cache: torch.Tensor,  # [2, H_kv, num_blocks, bs * D]
    plan: TorchAttentionPlan,
    scale: float,
    output: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    assert plan.decode_block_ids is not None and plan.decode_token_idx is not None
    assert plan.decode_mask is not None
    bd = plan.decode_token_idx.numel()
    num_q_heads = query.shape[1]
    group = num_q_heads // num_kv_heads
    kv = flat_cache.index_select(2, plan.decode_block_ids)  # [2, H_kv, Bd * nb, bs * D]
    kv = kv.view(2, num_kv_heads, bd, -1, head_dim)  # [2, H_kv, Bd, L, D]
    # Batched (head, sequence) first, so K/V are used as gathered; each KV head's G query
    # heads are G query rows of one small matmul, so K/V are never repeated. Two matmuls
    # in the cache dtype with an fp32 softmax beat SDPA's flash kernel (built for long query
    # blocks) about twice over on CPU.
    q = query[plan.decode_token_idx].view(bd, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.matmul(q.to(kv.dtype), kv[0].transpose(-1, -2)).float()  # [H_kv, Bd, G, L]
    scores.mul_(scale).add_(plan.decode_mask)
    probs = scores.softmax(dim=-1).to(kv.dtype)
    out = torch.matmul(probs, kv[1])  # [H_kv, Bd, G, D]
    output[plan.decode_token_idx] = (
        out.transpose(0, 1).reshape(bd, num_q_heads, head_dim).to(output.dtype)
    )
