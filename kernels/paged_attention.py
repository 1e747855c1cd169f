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
    # Written as two batched matmuls rather than SDPA: with a padding mask, CPU SDPA takes a
    # slow generic path, and the grouped-query layout needs no repeated K/V this way.
    block_size = kv_cache.shape[2]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    bd = rows.numel()
    num_q_heads = query.shape[1]
    lens = torch.tensor(seq_lens, device=query.device)[rows]  # [Bd]
    num_blocks = (max(seq_lens[i] for i in rows.tolist()) + block_size - 1) // block_size
    token_idx = torch.tensor(query_start_loc[:-1], device=query.device)[rows]  # [Bd]
    kv = kv_cache[:, block_table[rows, :num_blocks]]  # [2, Bd, nb, bs, H_kv, D]
    kv = kv.reshape(2, bd, -1, num_kv_heads, head_dim)  # [2, Bd, L, H_kv, D]
    k = kv[0].permute(0, 2, 3, 1)  # [Bd, H_kv, D, L]
    v = kv[1].transpose(1, 2)  # [Bd, H_kv, L, D]
    q = query[token_idx].view(bd, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q.to(k.dtype), k).float() * scale  # [Bd, H_kv, G, L]
    pad = torch.arange(scores.shape[-1], device=query.device)[None, :] >= lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)  # [Bd, H_kv, G, L]
    out = torch.matmul(probs, v)  # [Bd, H_kv, G, D]
    output[token_idx] = out.reshape(bd, num_q_heads, head_dim).to(output.dtype)
