"""Paged attention on CPU with the native kernels (`csrc/cpu_kernels.c`): the "cpu" backend.

Same contract as the torch reference in `paged_attention.py`, with one difference in the cache:
each key block is stored transposed, `[D, block_size]` inside the `[2, H_kv, num_blocks,
block_size, D]` tensor (see the C file for why). `reshape_and_cache_cpu` writes that layout and
everything here reads it, so a cache must be written and read by this backend alone.

- Decodes (one query token) run in the C kernel, which reads the K/V blocks where they lie:
  no gather copy, fp32 scores and softmax, parallel over (sequence, KV head).
- Prefill chunks run torch's SDPA, as in the reference (its flash kernel is GEMM-based, which
  suits many query tokens); a cached prefix is gathered and its key blocks transposed back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, require_native
from asyncengine.kernels.paged_attention import _Prefill, attend_prefills, plan_prefills


@dataclass(slots=True)
class CpuAttentionPlan:
    """One step's attention layout, shared by every layer."""

    decode_token_idx: torch.Tensor  # [Bd] int64 packed positions of single-token queries
    decode_block_table: torch.Tensor  # [Bd, nb] int32 their block ids
    decode_seq_lens: torch.Tensor  # [Bd] int32 their context lengths
    prefills: list[_Prefill]
    num_threads: int


def plan_paged_attention_cpu(
    query_start_loc: list[int],  # B + 1 offsets into the packed tokens
    seq_lens: list[int],  # [B] context length including this step's tokens
    block_table: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    dtype: torch.dtype,
) -> CpuAttentionPlan:
    decode_rows = [
        i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] == 1
    ]
    nb = -(-max((seq_lens[i] for i in decode_rows), default=0) // block_size)
    return CpuAttentionPlan(
        decode_token_idx=torch.tensor([query_start_loc[i] for i in decode_rows], dtype=torch.int64),
        decode_block_table=block_table[decode_rows, :nb].to(torch.int32).contiguous(),
        decode_seq_lens=torch.tensor([seq_lens[i] for i in decode_rows], dtype=torch.int32),
        prefills=plan_prefills(query_start_loc, seq_lens, block_table, block_size, dtype),
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
    output = torch.empty(query.shape, dtype=query.dtype)
    num_decodes = plan.decode_token_idx.numel()
    if num_decodes:
        _check_cache(kv_cache)
        num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
        q = _rows_contiguous(query.to(kv_cache.dtype))
        out = output if output.dtype == kv_cache.dtype else torch.empty_like(q)
        require_native().paged_decode(
            DTYPE_CODES[kv_cache.dtype],
            q.data_ptr(), q.stride(0), q.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            kv_cache.data_ptr(), num_kv_heads, num_blocks, block_size, head_dim,
            query.shape[1] // num_kv_heads,
            plan.decode_token_idx.data_ptr(),
            plan.decode_block_table.data_ptr(), plan.decode_block_table.stride(0),
            plan.decode_seq_lens.data_ptr(), num_decodes,
            scale, plan.num_threads,
        )  # fmt: skip
        if out is not output:
            output[plan.decode_token_idx] = out[plan.decode_token_idx].to(output.dtype)
    if plan.prefills:
        attend_prefills(
            query, key, value, kv_cache, plan.prefills, scale, output, keys_transposed=True
        )
    return output


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
