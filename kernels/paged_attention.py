"""Paged attention over a packed varlen batch: the torch reference backend.

Each sequence i contributes `q_len_i = query_start_loc[i+1] - query_start_loc[i]` query tokens,
the last `q_len_i` of its `seq_lens[i]` tokens (the earlier ones are an already-cached prefix).
Attention is causal; K/V come from the paged cache through `block_table`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_torch(
    query: torch.Tensor,  # [T, H_q, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, D]
    query_start_loc: list[int],  # B + 1 offsets into the T packed tokens
    seq_lens: list[int],  # [B] context length including this step's tokens
    block_table: torch.Tensor,  # [B, max_blocks] int64
    scale: float,
    decode_rows: torch.Tensor | None = None,  # rows with q_len == 1, batched together
) -> torch.Tensor:  # [T, H_q, D]
    """Torch reference: decodes in one batched SDPA call, prefill chunks one sequence at a time."""
    output = torch.empty_like(query)
    block_size = kv_cache.shape[2]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    gqa = query.shape[1] != num_kv_heads
    if decode_rows is not None and decode_rows.numel() > 0:
        _decode(query, kv_cache, query_start_loc, seq_lens, block_table, scale, decode_rows, output)
    is_decode = [False] * len(seq_lens)
    if decode_rows is not None:
        for i in decode_rows.tolist():
            is_decode[i] = True
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if is_decode[i] or end == start:
            continue
        q_len = end - start
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_table[i, :num_blocks]
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, H_kv, D]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H_q, q_len, D]
        mask = None
        if seq_len != q_len:
            # Query j sits at position seq_len - q_len + j and sees keys up to it.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )  # [1, H_q, q_len, D]
        output[start:end] = o[0].transpose(0, 1)
    return output


def _decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    scale: float,
    rows: torch.Tensor,  # [Bd] indices of decode sequences
    output: torch.Tensor,
) -> None:
    block_size = kv_cache.shape[2]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    lens = torch.tensor(seq_lens, device=query.device)[rows]  # [Bd]
    max_len = int(lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    token_idx = torch.tensor(query_start_loc[:-1], device=query.device)[rows]  # [Bd]
    blocks = block_table[rows, :num_blocks]  # [Bd, nb]
    bd = rows.numel()
    k = kv_cache[0, blocks].reshape(bd, -1, num_kv_heads, head_dim)  # [Bd, nb*bs, H_kv, D]
    v = kv_cache[1, blocks].reshape(bd, -1, num_kv_heads, head_dim)
    mask = torch.arange(k.shape[1], device=query.device)[None, :] < lens[:, None]  # [Bd, L]
    q = query[token_idx].unsqueeze(2)  # [Bd, H_q, 1, D]
    o = F.scaled_dot_product_attention(
        q,
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads,
    )  # [Bd, H_q, 1, D]
    output[token_idx] = o.squeeze(2)
