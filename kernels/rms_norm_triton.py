# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""RMSNorm with an optional fused residual add: Triton.

Same contract and signature as `rms_norm_torch` (see `rms_norm.py`). Each program normalizes
BLOCK_T whole rows (the row fits one tile, up to 64Ki elements), so the residual add, the mean
square and the scaling read each row once and write it once.
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
    tl_sum,
)

_MAX_TILE = 1 << 16  # elements of one program's tile


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] (HAS_RESIDUAL only)
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    num_rows,
    num_cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    rows = rows.to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_N]
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + rows[:, None] * stride_r + cols[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the residual's dtype, as the unfused `residual + hidden` does.
        total = cast_rne(x + r, residual_ptr.dtype.element_ty)
        tl.store(r_ptrs, total, mask=mask)
        x = total.to(tl.float32)
    mean_square = tl_sum(x * x, axis=1) / num_cols  # [BLOCK_T]
    normed = x * tl.rsqrt(mean_square + eps)[:, None]
    normed = cast_rne(normed, out_ptr.dtype.element_ty).to(tl.float32)  # LlamaRMSNorm's rounding
    w = tl.load(weight_ptr + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_o + cols[None, :]
    tl.store(out_ptrs, cast_rne(normed * w[None, :], out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [..., N]; not modified
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., N]: residual += x first, then norm(residual)
) -> torch.Tensor:  # [..., N] like x
    """The RMS-normalized rows of `x` (of the sum, after the residual add), as a new tensor
    (Triton). `residual`'s rows must be contiguous (any row stride)."""
    check_device(_rms_norm_kernel, x)
    num_cols = x.shape[-1]
    rows = x.reshape(-1, num_cols)  # [T, N], a view where it can be
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    res = residual.view(-1, num_cols) if residual is not None else None
    assert res is None or res.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = rows.shape[0]
    if num_rows == 0:
        return out
    block_n = next_power_of_2(num_cols)
    assert block_n <= _MAX_TILE, f"rows of {num_cols} elements are too wide for one tile"
    # Compiled: rows of ~4Ki elements per program; the interpreter pays per program, so it
    # takes as many rows as fit one tile.
    budget = _MAX_TILE if is_interpreted(_rms_norm_kernel) else 4096
    block_t = min(next_power_of_2(num_rows), max(1, budget // block_n))
    _rms_norm_kernel[(triton.cdiv(num_rows, block_t),)](
        rows,
        res if res is not None else rows,
        weight,
        out,
        num_rows,
        num_cols,
        eps,
        rows.stride(0),
        res.stride(0) if res is not None else 0,
        num_cols,
        HAS_RESIDUAL=res is not None,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        num_warps=max(1, min(8, block_t * block_n // 512)),
        **LAUNCH_OPTIONS,
    )
    return out
