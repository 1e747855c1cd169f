"""The "cpu" backend's native kernels against the torch reference and a dense fp32 truth.

Batches mix decodes, whole prefills and prefill chunks over a cached prefix, with GQA/MQA
group sizes (including ones that are not powers of two), head sizes 16 to 128, block sizes 16
(the kernel's specialised path) and 8 / 32, and fp32 / fp16 / bf16 caches.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.paged_attention_cpu import (
    CpuAttentionPlan,
    paged_attention_cpu,
    plan_paged_attention_cpu,
)
from asyncengine.kernels.reshape_and_cache_cpu import (
    read_cache_cpu,
    reshape_and_cache_cpu,
    to_cpu_layout,
)
from asyncengine.testing.paged_batches import (
    PagedBatch,
    dense_attention,
    make_paged_batch,
    max_error,
    torch_reference,
)

pytestmark = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Max abs error against the fp32 truth, for outputs of unit-variance inputs. The kernel keeps
# fp32 scores and probabilities, so it sits closer to the truth than the reference does.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def cpu_cache(b: PagedBatch) -> torch.Tensor:
    """The batch's cache in the cpu backend's layout, this step's K/V written natively."""
    cache = to_cpu_layout(b.base_cache)
    reshape_and_cache_cpu(b.key, b.value, cache, b.slot_mapping)
    return cache


def run_cpu(b: PagedBatch, scale: float, native_max_query_len: int = 256) -> torch.Tensor:
    plan = plan_paged_attention_cpu(
        b.query_start_loc, b.seq_lens, b.block_table, b.block_size, b.query.dtype,
        native_max_query_len=native_max_query_len,
    )  # fmt: skip
    out = paged_attention_cpu(b.query, b.key, b.value, cpu_cache(b), plan, scale)
    assert out.dtype == b.query.dtype and out.shape == b.query.shape
    return out


# A sequence: (kind, query tokens, cached prefix).
sequences = st.one_of(
    st.tuples(st.just("decode"), st.just(1), st.integers(0, 300)),
    st.tuples(st.just("prefill"), st.integers(2, 40), st.just(0)),
    st.tuples(st.just("chunk"), st.integers(2, 40), st.integers(1, 100)),
)


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(sequences, min_size=1, max_size=6),
    heads=st.sampled_from([(1, 1), (4, 4), (4, 2), (6, 2), (9, 3), (8, 1), (32, 2)]),
    head_dim=st.sampled_from([16, 32, 64, 128]),
    block_size=st.sampled_from([8, 16, 32, 64]),
    dtype=st.sampled_from(DTYPES),
    native_max_query_len=st.sampled_from([1, 6, 256]),
    seed=st.integers(0, 2**16),
)
@example(
    seqs=[("decode", 1, 17), ("decode", 1, 0), ("chunk", 5, 11), ("prefill", 7, 0)],
    heads=(9, 3),
    head_dim=64,
    block_size=16,
    dtype=torch.bfloat16,
    native_max_query_len=256,
    seed=0,
)
def test_matches_reference_and_truth(
    seqs: list[tuple[str, int, int]],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    native_max_query_len: int,
    seed: int,
) -> None:
    # native_max_query_len splits the sequences between the C kernel (decodes and chunks up to
    # that many query tokens, in tiles) and SDPA (longer chunks).
    q_lens = [q for _, q, _ in seqs]
    seq_lens = [q + prefix for _, q, prefix in seqs]
    b = make_paged_batch(q_lens, seq_lens, *heads, head_dim, block_size, dtype, seed)
    scale = head_dim**-0.5
    # The native writer produces exactly the reference cache, in its own layout.
    assert torch.equal(read_cache_cpu(cpu_cache(b)), b.kv_cache)
    truth = dense_attention(b, scale)
    out = run_cpu(b, scale, native_max_query_len)
    assert max_error(out, truth) <= TOLERANCE[dtype]
    # And no worse than the torch reference (plus one rounding of the output dtype).
    ref_error = max_error(torch_reference(b, scale), truth)
    assert max_error(out, truth) <= ref_error + TOLERANCE[dtype] / 2


def test_strided_query_and_fp32_exactness() -> None:
    # transformers hands over [1, H, T, D] views of [T, H, D] memory: the kernel reads strides.
    b = make_paged_batch([1, 1, 3], [40, 1, 20], 8, 2, 32, 16, torch.float32, seed=3)
    q_strided = b.query.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D], odd strides
    assert not q_strided.is_contiguous()
    plan = plan_paged_attention_cpu(b.query_start_loc, b.seq_lens, b.block_table, 16, torch.float32)
    out = paged_attention_cpu(q_strided, b.key, b.value, cpu_cache(b), plan, 0.2)
    torch.testing.assert_close(out, dense_attention(b, 0.2), rtol=1e-5, atol=1e-5)


def test_decode_over_long_context_and_many_threads() -> None:
    b = make_paged_batch([1] * 5, [1, 15, 16, 17, 2049], 4, 2, 64, 16, torch.bfloat16, seed=7)
    plan = plan_paged_attention_cpu(b.query_start_loc, b.seq_lens, b.block_table, 16, b.query.dtype)
    plan.num_threads = 3  # more threads than this machine's cores still splits the work
    out = paged_attention_cpu(b.query, b.key, b.value, cpu_cache(b), plan, 0.125)
    assert max_error(out, dense_attention(b, 0.125)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_a_decode_steps_plan_has_a_block_table_of_its_own_width(num_seqs: int) -> None:
    """A decode-only step's plan (its own short path): one query token per sequence, and a
    block table cut to the blocks the longest sequence uses, with rows of exactly that width
    (the kernel walks rows by the stride; a wider one once made a one-row decode hang)."""
    seq_lens = [17, 40, 3][:num_seqs]
    table = torch.arange(num_seqs * 9, dtype=torch.int64).view(num_seqs, 9)  # 9 > needed
    plan = plan_paged_attention_cpu(list(range(num_seqs + 1)), seq_lens, table, 16, torch.bfloat16)
    nb = -(-max(seq_lens) // 16)
    assert plan.prefills == []
    assert plan.q_start.tolist() == list(range(num_seqs))
    assert plan.q_lens.tolist() == [1] * num_seqs and plan.q_lens.dtype == torch.int32
    assert plan.seq_lens.tolist() == seq_lens and plan.seq_lens.dtype == torch.int32
    assert plan.block_table.dtype == torch.int32 and plan.block_table.stride() == (nb, 1)
    assert torch.equal(plan.block_table, table[:, :nb].to(torch.int32))


def _unsound(plan: CpuAttentionPlan, fault: str) -> str:
    """Spoil one of a two-sequence decode plan's tables; the message the engine should give."""
    if fault == "short row":  # the second sequence (40 tokens) needs 3 blocks of 16
        plan.block_table = plan.block_table[:, :2].contiguous()
        return "sequence 1 of 40 tokens needs 3 blocks of 16, its block table row has 2"
    if fault == "block id":
        plan.block_table[1, 2] = 1_000
        return "sequence 1's block table holds block 1000; the cache has blocks 0 to"
    plan.q_lens[0] = 30  # more query tokens than the sequence's 17
    return "sequence 0 has 30 query tokens at row 0 of 17 in all"


FAULTS = ["short row", "block id", "query tokens"]


@pytest.mark.parametrize("fault", FAULTS)
def test_unsound_tables_are_refused_with_a_message(fault: str) -> None:
    """Tables the engine would never build (a row too short for its sequence, a block id
    outside the cache, more query tokens than the sequence) are refused before any item runs:
    the kernel would read outside the cache."""
    b = make_paged_batch([1, 1], [17, 40], 4, 2, 64, 16, torch.bfloat16, seed=3)
    plan = plan_paged_attention_cpu(b.query_start_loc, b.seq_lens, b.block_table, 16, b.query.dtype)
    message = _unsound(plan, fault)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention_cpu(b.query, b.key, b.value, cpu_cache(b), plan, 0.125)


@pytest.mark.parametrize("fault", FAULTS)
def test_the_pool_entry_refuses_unsound_tables_instead_of_waiting(fault: str) -> None:
    """decode_layers.c's attention on the work pool: its items skip what they cannot run, so
    unsound tables once left the call waiting forever for their commits. Now -2 at once."""
    lib = load_native()
    assert lib is not None
    pool = ctypes.CDLL(str(lib.path)).ae_paged_attention_pool
    pool.restype = ctypes.c_int
    b = make_paged_batch([1, 1], [17, 40], 4, 2, 64, 16, torch.bfloat16, seed=3)
    plan = plan_paged_attention_cpu(b.query_start_loc, b.seq_lens, b.block_table, 16, b.query.dtype)
    _unsound(plan, fault)
    cache = cpu_cache(b)
    query = b.query.reshape(b.query.shape[0], -1).contiguous()
    out = torch.zeros_like(query)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    status = pool(
        ptr(query.data_ptr()), i64(query.stride(0)), i64(4), ptr(out.data_ptr()),
        i64(out.stride(0)), ptr(cache.data_ptr()), i64(2), i64(cache.shape[2]), i64(16), i64(64),
        ptr(plan.q_start.data_ptr()), ptr(plan.q_lens.data_ptr()), ptr(plan.seq_lens.data_ptr()),
        ptr(plan.block_table.data_ptr()), i64(plan.block_table.stride(0)),
        i64(plan.q_start.numel()), ctypes.c_float(0.125), ctypes.c_int(2),
    )  # fmt: skip
    assert status == -2
    assert not out.any()  # nothing written
