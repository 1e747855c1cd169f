"""Paged attention: the Triton kernels against the torch reference and a dense fp32 truth.

Batches mix decodes (one query token), whole prefills and prefill chunks over an already-cached
prefix, with GQA/MQA group sizes including non-powers of two, head sizes 16 to 256, block
sizes 16 and 32, fp32/fp16/bf16, and the split-K decode path.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncengine.kernels.paged_attention_triton import (
    paged_attention_triton,
    plan_paged_attention_triton,
)
from asyncengine.testing.paged_batches import (
    PagedBatch,
    dense_attention,
    make_paged_batch,
    max_error,
    torch_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Max abs error against the fp32 truth, for outputs of unit-variance inputs.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def run_triton(b: PagedBatch, device: str, scale: float, num_splits: int | None) -> torch.Tensor:
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
    b = make_paged_batch(
        q_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    truth = dense_attention(b, scale)
    got = run_triton(b, device, scale, num_splits)
    assert max_error(got, truth) <= TOLERANCE[dtype]
    # The torch reference (the CPU backend) agrees with the same truth, so the two backends
    # agree with each other.
    assert max_error(torch_reference(b, scale), truth) <= TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits", [2, 7, 16])
def test_split_k_long_decodes(device: str, num_splits: int) -> None:
    """Flash-decoding: splits of unequal sequences, some of them empty, combine exactly."""
    seq_lens = [1000, 3, 130, 640]
    b = make_paged_batch([1] * 4, seq_lens, 4, 2, 64, 32, torch.float32, seed=1)
    truth = dense_attention(b, 0.125)
    got = run_triton(b, device, 0.125, num_splits)
    assert max_error(got, truth) <= TOLERANCE[torch.float32]


def test_chunk_spanning_many_tiles_after_a_long_prefix(device: str) -> None:
    """A prefill chunk longer than several query tiles, after a prefix of many blocks."""
    b = make_paged_batch([70, 1], [70 + 190, 50], 6, 2, 32, 16, torch.float16, seed=2)
    truth = dense_attention(b, 0.2)
    assert max_error(run_triton(b, device, 0.2, None), truth) <= TOLERANCE[torch.float16]


def test_warm_up_decode_runs_every_split_variant_and_writes_nothing(device: str) -> None:
    from asyncengine.kernels.paged_attention_triton import warm_up_decode

    cache = torch.randn((2, 2, 3, 16, 32), dtype=torch.float32, device=device)
    before = cache.clone()
    warm_up_decode(cache, num_q_heads=4)
    assert torch.equal(cache, before)
