"""Random packed batches over a paged KV cache, and dense attention as their truth.

For the attention kernels' tests: every backend is checked against `dense_attention` on the
same `PagedBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H_q, D]
    key: torch.Tensor  # [T, H_kv, D] this step's keys
    value: torch.Tensor  # [T, H_kv, D]
    base_cache: torch.Tensor  # [2, H_kv, num_blocks, block_size, D] before this step's write
    kv_cache: torch.Tensor  # the same after the torch reference wrote this step's K/V
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: list[int]  # B + 1
    seq_lens: list[int]  # [B] tokens in the cache after this step
    block_table: torch.Tensor  # [B, max_blocks] int64
    block_size: int


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> PagedBatch:
    """Sequence i has `q_lens[i]` new tokens at the end of its `seq_lens[i]`; the sequences own
    shuffled cache blocks (plus unused ones); cached prefixes and garbage are random."""
    from asyncengine.kernels.reshape_and_cache import reshape_and_cache_torch

    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int64)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_table[i, :nb] = order[used : used + nb]
        used += nb
    base = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    total = sum(q_lens)
    query = torch.randn(total, num_q_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(block_table[i, pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.cat(slots)
    kv_cache = base.clone()
    reshape_and_cache_torch(key, value, kv_cache, slot_mapping)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return PagedBatch(
        query, key, value, base, kv_cache, slot_mapping, starts, list(seq_lens), block_table,
        block_size,
    )  # fmt: skip


def dense_attention(b: PagedBatch, scale: float) -> torch.Tensor:  # [T, H_q, D] fp32
    """Causal attention per sequence on fp32 copies of its gathered (reference-layout) cache."""
    num_kv_heads, _, block_size, head_dim = b.kv_cache.shape[1:]
    group = b.query.shape[1] // num_kv_heads
    flat = b.kv_cache.float().view(2, num_kv_heads, -1, head_dim)  # [2, H_kv, num_slots, D]
    out = torch.empty(b.query.shape, dtype=torch.float32)
    for i, seq_len in enumerate(b.seq_lens):
        start, end = b.query_start_loc[i], b.query_start_loc[i + 1]
        pos = torch.arange(seq_len)
        slots = b.block_table[i, pos // block_size] * block_size + pos % block_size
        kv = flat[:, :, slots]  # [2, H_kv, S, D]
        k = kv[0].repeat_interleave(group, 0)  # [H_q, S, D]
        v = kv[1].repeat_interleave(group, 0)
        q = b.query[start:end].float().transpose(0, 1)  # [H_q, q_len, D]
        scores = q @ k.transpose(1, 2) * scale  # [H_q, q_len, S]
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def torch_reference(b: PagedBatch, scale: float) -> torch.Tensor:  # [T, H_q, D]
    """The torch reference backend on the batch (reference-layout cache)."""
    from asyncengine.kernels.paged_attention import (
        paged_attention_torch,
        plan_paged_attention_torch,
    )

    plan = plan_paged_attention_torch(
        b.query_start_loc, b.seq_lens, b.block_table, b.block_size, b.query.dtype
    )
    out: torch.Tensor = paged_attention_torch(b.query, b.key, b.value, b.kv_cache, plan, scale)
    return out


def max_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    return float((out.float() - truth).abs().max())
