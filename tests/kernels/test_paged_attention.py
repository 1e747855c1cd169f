"""Paged attention: the Triton kernels against the torch reference and a dense fp32 truth.

Batches mix decodes (one query token), whole prefills and prefill chunks over an already-cached
prefix, with GQA/MQA group sizes including non-powers of two, head sizes 16 to 256, block
sizes 16 and 32, fp32/fp16/bf16, and the split-K decode path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncengine.kernels.paged_attention import paged_attention_torch, plan_paged_attention_torch
from asyncengine.kernels.paged_attention_triton import (
    paged_attention_triton,
    plan_paged_attention_triton,
)
from asyncengine.kernels.reshape_and_cache import reshape_and_cache_torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Max abs error against the fp32 truth, for outputs of unit-variance inputs.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class Batch:
    query: torch.Tensor  # [T, H_q, D]
    key: torch.Tensor  # [T, H_kv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, H_kv, num_blocks, block_size, D], holding every token
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [B, max_blocks]
    block_size: int


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> Batch:
    """A packed batch whose sequences own shuffled cache blocks (plus unused ones)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int64)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_table[i, :nb] = order[used : used + nb]
        used += nb
    # The cached prefixes (and garbage elsewhere) come from the random cache; this step's
    # keys and values are written by the reference copy, as the model does.
    kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=g)
    kv_cache = kv_cache.to(dtype)
    total = sum(q_lens)
    query = torch.randn(total, num_q_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(block_table[i, pos // block_size] * block_size + pos % block_size)
    reshape_and_cache_torch(key, value, kv_cache, torch.cat(slots))
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return Batch(query, key, value, kv_cache, starts, seq_lens, block_table, block_size)


def dense_truth(b: Batch, scale: float) -> torch.Tensor:  # [T, H_q, D] fp32
    """Causal attention per sequence on fp32 copies of the gathered cache."""
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


def run_triton(b: Batch, device: str, scale: float, num_splits: int | None) -> torch.Tensor:
    block_table = b.block_table.to(device)
    plan = plan_paged_attention_triton(
        b.query_start_loc, b.seq_lens, block_table, b.block_size, b.query.dtype
    )
    plan.num_splits = num_splits
    out = paged_attention_triton(
        b.query.to(device),
        b.key.to(device),
        b.value.to(device),
        b.kv_cache.to(device),
        plan,
        scale,
    )
    assert out.dtype == b.query.dtype and out.shape == b.query.shape
    return out.cpu()


def run_torch(b: Batch, scale: float) -> torch.Tensor:
    plan = plan_paged_attention_torch(
        b.query_start_loc, b.seq_lens, b.block_table, b.block_size, b.query.dtype
    )
    return paged_attention_torch(b.query, b.key, b.value, b.kv_cache, plan, scale)


def max_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    return float((out.float() - truth).abs().max())


# A sequence: (kind, query tokens, cached prefix).
sequences = st.one_of(
    st.tuples(st.just("decode"), st.just(1), st.integers(0, 200)),
    st.tuples(st.just("prefill"), st.integers(2, 40), st.just(0)),
    st.tuples(st.just("chunk"), st.integers(2, 40), st.integers(1, 100)),
)


@settings(max_examples=30, deadline=None)
@given(
    seqs=st.lists(sequences, min_size=1, max_size=4),
    num_kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    head_dim=st.sampled_from([16, 32, 64, 80, 128, 256]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from(DTYPES),
    num_splits=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
@example(  # MQA, every kind at once, split decodes, the smallest block size
    seqs=[("decode", 1, 150), ("prefill", 33, 0), ("chunk", 17, 40), ("decode", 1, 0)],
    num_kv_heads=1,
    group=8,
    head_dim=128,
    block_size=16,
    dtype=torch.bfloat16,
    num_splits=3,
    seed=0,
)
def test_matches_reference(
    device: str,
    seqs: list[tuple[str, int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int | None,
    seed: int,
) -> None:
    q_lens = [q for _, q, _ in seqs]
    seq_lens = [q + ctx for _, q, ctx in seqs]
    b = make_batch(
        q_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    truth = dense_truth(b, scale)
    got = run_triton(b, device, scale, num_splits)
    assert max_error(got, truth) <= TOLERANCE[dtype]
    # The torch reference (the CPU backend) agrees with the same truth, so the two backends
    # agree with each other.
    assert max_error(run_torch(b, scale), truth) <= TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits", [2, 7, 16])
def test_split_k_long_decodes(device: str, num_splits: int) -> None:
    """Flash-decoding: splits of unequal sequences, some of them empty, combine exactly."""
    seq_lens = [1000, 3, 130, 640]
    b = make_batch([1] * 4, seq_lens, 4, 2, 64, 32, torch.float32, seed=1)
    truth = dense_truth(b, 0.125)
    got = run_triton(b, device, 0.125, num_splits)
    assert max_error(got, truth) <= TOLERANCE[torch.float32]


def test_chunk_spanning_many_tiles_after_a_long_prefix(device: str) -> None:
    """A prefill chunk longer than several query tiles, after a prefix of many blocks."""
    b = make_batch([70, 1], [70 + 190, 50], 6, 2, 32, 16, torch.float16, seed=2)
    truth = dense_truth(b, 0.2)
    assert max_error(run_triton(b, device, 0.2, None), truth) <= TOLERANCE[torch.float16]
