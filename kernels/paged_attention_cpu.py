"""Paged attention on CPU with the native kernels (`csrc/cpu_kernels.c`): the "cpu" backend.

Same contract as the torch reference in `paged_attention.py`, with one difference in the cache:
each key block is stored transposed, `[D, block_size]` inside the `[2, H_kv, num_blocks,
block_size, D]` tensor (see the C file for why). `reshape_and_cache_cpu` writes that layout and
everything here reads it, so a cache must be written and read by this backend alone.

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


def paged_attention_cpu(
    query: torch.Tensor,  # [T, H_q, D]
    key: torch.Tensor,  # [T, H_kv, D] this step's keys (also written to the cache)
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D], key blocks transposed
    plan: CpuAttentionPlan,
    scale: float,
) -> torch.Tensor:  # [T, H_q, D]
    _check_cache(kv_cache)
    q = _rows_contiguous(query.to(kv_cache.dtype))
    # The kernel writes the rows of the sequences it attends; SDPA the rest.
    output = torch.empty(q.shape, dtype=kv_cache.dtype)
    num_native = plan.q_start.numel()
    if num_native:
        num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
        require_native().paged_attention(
            DTYPE_CODES[kv_cache.dtype],
            q.data_ptr(), q.stride(0), q.stride(1),
            output.data_ptr(), output.stride(0), output.stride(1),
            kv_cache.data_ptr(), num_kv_heads, num_blocks, block_size, head_dim,
            query.shape[1] // num_kv_heads,
            plan.q_start.data_ptr(), plan.q_lens.data_ptr(), plan.seq_lens.data_ptr(),
            plan.block_table.data_ptr(), plan.block_table.stride(0), num_native,
            scale, plan.num_threads,
        )  # fmt: skip
    if plan.prefills:
        attend_prefills(q, key, value, kv_cache, plan.prefills, scale, output, keys_transposed=True)
    return output if output.dtype == query.dtype else output.to(query.dtype)


def reshape_and_cache_cpu(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D], key blocks transposed
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write K/V rows into their cache slots, in place, key blocks transposed."""
    _check_cache(kv_cache)
    k = _rows_contiguous(key.to(kv_cache.dtype))
    v = _rows_contiguous(value.to(kv_cache.dtype))
    slots = slot_mapping.to(torch.int64).contiguous()
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    require_native().reshape_and_cache(
        DTYPE_CODES[kv_cache.dtype],
        k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1),
        kv_cache.data_ptr(), num_kv_heads, num_blocks, block_size, head_dim,
        slots.data_ptr(), slots.numel(), torch.get_num_threads(),
    )  # fmt: skip


def read_cache_cpu(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache in the reference layout (keys un-transposed): a copy, for tests and checks."""
    out = kv_cache.clone()
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    out[0] = kv_cache[0].reshape(num_kv_heads, num_blocks, head_dim, block_size).transpose(-1, -2)
    return out


def to_cpu_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """A reference-layout cache converted to this backend's (keys transposed): a copy."""
    out = kv_cache.clone()
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    out[0].view(num_kv_heads, num_blocks, head_dim, block_size).copy_(kv_cache[0].transpose(-1, -2))
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels take any token and head strides, but each head's D values must be adjacent.
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise ValueError("the native CPU kernels need a contiguous CPU KV cache")
    if kv_cache.dtype not in DTYPE_CODES:
        raise ValueError(f"KV cache dtype {kv_cache.dtype}: expected float32, bfloat16, float16")
