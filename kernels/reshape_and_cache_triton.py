# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""reshape_and_cache, Triton: write the new tokens' K/V into the paged cache at `slot_mapping`.

Same contract as `reshape_and_cache_torch` (see `reshape_and_cache.py` for the cache layout),
plus: a negative slot skips its token (padding). Each program copies a `[BLOCK_T, D]` tile of
one KV head for K and for V; the copy converts to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.triton_utils import (
    LAUNCH_OPTIONS,
    cast_rne,
    check_device,
    is_interpreted,
    next_power_of_2,
)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, H_kv, D]
    value_ptr,  # [T, H_kv, D]
    cache_ptr,  # [2, H_kv, num_blocks, block_size, D]
    slot_ptr,  # [T]
    num_tokens,
    head_dim,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_h,
    stride_c_blk,
    stride_c_off,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    head = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    dim = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    mask = ((tok < num_tokens) & (slot >= 0))[:, None] & (dim < head_dim)[None, :]
    tok = tok.to(tl.int64)  # large T * stride products stay exact
    # Slot s is offset s % block_size of block s // block_size.
    dst = (
        cache_ptr
        + head * stride_c_h
        + (slot // block_size)[:, None] * stride_c_blk
        + (slot % block_size)[:, None] * stride_c_off
        + dim[None, :]
    )  # [BLOCK_T, BLOCK_D]
    k = tl.load(key_ptr + tok[:, None] * stride_kt + head * stride_kh + dim[None, :], mask=mask)
    tl.store(dst, cast_rne(k, cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + tok[:, None] * stride_vt + head * stride_vh + dim[None, :], mask=mask)
    tl.store(dst + stride_c_kv, cast_rne(v, cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D]
    slot_mapping: torch.Tensor,  # [T] int64 (or int32); negative: skip the token
) -> None:
    """Scatter K/V rows into their cache slots, in place (Triton)."""
    check_device(_reshape_and_cache_kernel, kv_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # The kernel indexes the head dimension with stride 1.
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    assert kv_cache.stride(-1) == 1, "the KV cache's head dimension must be contiguous"
    block_d = next_power_of_2(head_dim)
    # The interpreter's cost is per program, so it takes every token at once; compiled, a
    # tile of about 2 KiB of elements per program keeps enough programs in flight.
    if is_interpreted(_reshape_and_cache_kernel):
        block_t = next_power_of_2(num_tokens)
    else:
        block_t = max(1, min(next_power_of_2(num_tokens), 2048 // block_d))
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    _reshape_and_cache_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_tokens,
        head_dim,
        kv_cache.shape[3],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        **LAUNCH_OPTIONS,
    )
