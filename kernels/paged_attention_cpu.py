"""Paged attention on CPU with the native kernel (`csrc/attention.c`): the "cpu" backend.

Same contract as the torch reference in `paged_attention.py`, over this backend's cache layout
(key blocks stored transposed; see `reshape_and_cache_cpu.py`, which writes it).

- Decodes and prefill chunks of up to NATIVE_MAX_QUERY_LEN query tokens run in the C kernel,
  which reads the K/V blocks where they lie (a cached prefix needs no gather), in parallel over
  (sequence, tile of query tokens, KV head) with fp32 scores and softmax. A tile's tokens share
  each key and value row loaded; one call covers the whole batch.
- Longer chunks run torch's SDPA, as in the reference: its GEMM-based flash kernel wins on long
  query blocks. A cached prefix is gathered with its key blocks transposed back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, require_native
from asyncengine.kernels.paged_attention import _Prefill, attend_prefills, plan_prefills
from asyncengine.kernels.reshape_and_cache_cpu import check_cache, rows_contiguous

# Sequences with at most this many query tokens (decodes, short prefill chunks) attend in the C
# kernel; longer chunks go to SDPA, whose GEMM-based flash kernel wins on long query blocks.
NATIVE_MAX_QUERY_LEN = 512


@dataclass(slots=True)
class CpuAttentionPlan:
    """One step's attention layout, shared by every layer."""

    # The sequences attended natively: packed start row, query tokens, context length, blocks.
    q_start: torch.Tensor  # [Bn] int64
    q_lens: torch.Tensor  # [Bn] int32
    seq_lens: torch.Tensor  # [Bn] int32
    block_table: torch.Tensor  # [Bn, nb] int32
    prefills: list[_Prefill]  # the longer chunks, for SDPA
    num_threads: int


def plan_paged_attention_cpu(
    query_start_loc: list[int],  # B + 1 offsets into the packed tokens
    seq_lens: list[int],  # [B] context length including this step's tokens
    block_table: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    dtype: torch.dtype,
    native_max_query_len: int = NATIVE_MAX_QUERY_LEN,
) -> CpuAttentionPlan:
    num_seqs = len(seq_lens)
    decode = list(query_start_loc) == list(range(num_seqs + 1))  # one query token each
    if num_seqs and native_max_query_len >= 1 and decode:
        # A decode step: the same plan without the general path's dozen numpy ops.
        nb = -(-max(seq_lens) // block_size)
        # A new [B, nb] table: a slice's `.to().contiguous()` of one row keeps the wider
        # row stride (torch ignores the strides of size-1 dims), which the kernel reads.
        table = torch.empty(num_seqs, nb, dtype=torch.int32)
        table.copy_(block_table[:, :nb])
        return CpuAttentionPlan(
            q_start=torch.arange(num_seqs, dtype=torch.int64),
            q_lens=torch.ones(num_seqs, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            prefills=[],
            num_threads=torch.get_num_threads(),
        )
    starts = np.asarray(query_start_loc, dtype=np.int64)
    q_lens = np.diff(starts)
    lens = np.asarray(seq_lens, dtype=np.int64)
    native = np.flatnonzero(q_lens <= native_max_query_len)
    nb = -(-int(lens[native].max(initial=0)) // block_size)
    prefills = plan_prefills(
        query_start_loc, seq_lens, block_table, block_size, dtype,
        min_query_len=native_max_query_len + 1,
    )  # fmt: skip
    return CpuAttentionPlan(
        q_start=torch.from_numpy(starts[native]),
        q_lens=torch.from_numpy(q_lens[native].astype(np.int32)),
        seq_lens=torch.from_numpy(lens[native].astype(np.int32)),
        block_table=block_table[torch.from_numpy(native), :nb].to(torch.int32).contiguous(),
        prefills=prefills,
        num_threads=torch.get_num_threads(),
    )


def unsound_tables_message(plan: CpuAttentionPlan, num_blocks: int, block_size: int) -> str:
    """Why the kernel refused a plan's tables (its tables_sound): the first sequence at fault."""
    width = plan.block_table.shape[1]
    for i, (start, q_len, seq_len) in enumerate(
        zip(plan.q_start.tolist(), plan.q_lens.tolist(), plan.seq_lens.tolist(), strict=True)
    ):
        needed = -(-seq_len // block_size)
        if start < 0 or q_len < 0 or seq_len < q_len:
            return (
                f"paged attention: sequence {i} has {q_len} query tokens at row {start} of "
                f"{seq_len} in all; the query tokens must be at a row >= 0 and at most its length"
            )
        if needed > width:
            return (
                f"paged attention: sequence {i} of {seq_len} tokens needs {needed} blocks of "
                f"{block_size}, its block table row has {width}"
            )
        ids = plan.block_table[i, :needed].tolist()
        bad = [b for b in ids if not 0 <= b < num_blocks]
        if bad:
            return (
                f"paged attention: sequence {i}'s block table holds block {bad[0]}; the cache "
                f"has blocks 0 to {num_blocks - 1}"
            )
    return "paged attention: the step's tables do not describe the cache"


def paged_attention_cpu(
    query: torch.Tensor,  # [T, H_q, D]
    key: torch.Tensor,  # [T, H_kv, D] this step's keys (also written to the cache)
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D], key blocks transposed
    plan: CpuAttentionPlan,
    scale: float,
) -> torch.Tensor:  # [T, H_q, D]
    check_cache(kv_cache)
    q = rows_contiguous(query.to(kv_cache.dtype))
    # The kernel writes the rows of the sequences it attends; SDPA the rest.
    output = torch.empty(q.shape, dtype=kv_cache.dtype)
    num_native = plan.q_start.numel()
    if num_native:
        num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
        status = require_native().paged_attention(
            DTYPE_CODES[kv_cache.dtype],
            q.data_ptr(), q.stride(0), q.stride(1),
            output.data_ptr(), output.stride(0), output.stride(1),
            kv_cache.data_ptr(), num_kv_heads, num_blocks, block_size, head_dim,
            query.shape[1] // num_kv_heads,
            plan.q_start.data_ptr(), plan.q_lens.data_ptr(), plan.seq_lens.data_ptr(),
            plan.block_table.data_ptr(), plan.block_table.stride(0), num_native,
            scale, plan.num_threads,
        )  # fmt: skip
        if status != 0:
            raise ValueError(unsound_tables_message(plan, num_blocks, block_size))
    if plan.prefills:
        attend_prefills(q, key, value, kv_cache, plan.prefills, scale, output, keys_transposed=True)
    return output if output.dtype == query.dtype else output.to(query.dtype)
