# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Rotary position embedding applied to queries and keys in place: Triton.

Same contract as `rotary_embedding_torch` (see `rotary.py` for the cache layout and the two
pair styles). One launch each for the queries and the keys; a program rotates BLOCK_T tokens of
one head, loading each token's cosines and sines once through its position.
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
def _rotary_kernel(
    x_ptr,  # [T, H, D]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_position, rot_dim]
    num_tokens,
    half,  # rot_dim / 2
    stride_xt,
    stride_xh,
    stride_cs,
    IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    head = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    i = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF] frequency index
    t_mask = tok < num_tokens
    mask = t_mask[:, None] & (i < half)[None, :]
    pos = tl.load(positions_ptr + tok, mask=t_mask, other=0).to(tl.int64)
    cs = cos_sin_ptr + pos[:, None] * stride_cs + i[None, :]
    cos = tl.load(cs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_HALF]
    sin = tl.load(cs + half, mask=mask, other=0.0).to(tl.float32)
    if IS_NEOX:
        off1 = i
        off2 = i + half
    else:
        off1 = 2 * i
        off2 = 2 * i + 1
    base = x_ptr + tok.to(tl.int64)[:, None] * stride_xt + head * stride_xh
    x1 = tl.load(base + off1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + off2[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(base + off1[None, :], cast_rne(x1 * cos - x2 * sin, x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + off2[None, :], cast_rne(x2 * cos + x1 * sin, x_ptr.dtype.element_ty), mask=mask)


def rotary_embedding_triton(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H_q, D], rotated in place
    key: torch.Tensor | None,  # [T, H_kv, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]
    is_neox: bool,
) -> None:
    """Rotate the first rot_dim dimensions of every head, in place (Triton)."""
    check_device(_rotary_kernel, query)
    num_tokens = query.shape[0]
    rot_dim = cos_sin_cache.shape[1]
    assert rot_dim % 2 == 0 and rot_dim <= query.shape[2]
    assert cos_sin_cache.stride(1) == 1
    if num_tokens == 0:
        return
    half = rot_dim // 2
    block_half = next_power_of_2(half)
    budget = 1 << 16 if is_interpreted(_rotary_kernel) else 1024
    block_t = min(next_power_of_2(num_tokens), max(1, budget // block_half))
    for x in (query, key):
        if x is None:
            continue
        assert x.stride(-1) == 1, "the head dimension must be contiguous"
        _rotary_kernel[(triton.cdiv(num_tokens, block_t), x.shape[1])](
            x,
            positions,
            cos_sin_cache,
            num_tokens,
            half,
            x.stride(0),
            x.stride(1),
            cos_sin_cache.stride(0),
            IS_NEOX=is_neox,
            BLOCK_T=block_t,
            BLOCK_HALF=block_half,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )
