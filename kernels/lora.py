"""LoRA's low-rank add over a batch of row segments, torch reference (Punica's shrink and
expand, the SGMV shape).

A step's packed rows belong to requests for different adapters, and to none. The base
projection runs once for every row; then, per adapter, its rows' `x @ A^T` (the shrink, to the
adapter's rank r) and `@ B^T` (the expand, back to the projection's width), scaled, are added
to those rows of the output. Projections that read the same input (q, k and v; gate and up)
shrink once, with their A matrices stacked. The products run in the adapter's dtype (fp32) and
are rounded to the output's dtype once, when added. A native CPU kernel is a later step: this
is its reference.
"""

from __future__ import annotations

import torch

# An adapter's rows in a step: a slice where they are contiguous (one request, or requests
# side by side: no gather, no scatter), else their indices [N] (int64).
Rows = slice | torch.Tensor


def lora_shrink(
    x: torch.Tensor,  # [T, in] the projection's input, every row of the step
    rows: Rows,
    a: torch.Tensor,  # [R, in] lora_A (of one or several projections, stacked)
) -> torch.Tensor:  # [N, R] in a's dtype
    """The adapter's rows of `x`, times A^T."""
    xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
    return xs.to(a.dtype) @ a.t()


def lora_expand_add(
    out: torch.Tensor,  # [T, out] the base product of every row (a 2-D view is fine), updated
    rows: Rows,
    shrunk: torch.Tensor,  # [N, r] this projection's part of lora_shrink's product
    b: torch.Tensor,  # [out, r] lora_B, already times the adapter's scale
) -> None:
    """`out[rows] += shrunk @ B^T`, rounded to out's dtype; other rows untouched."""
    delta = (shrunk @ b.t()).to(out.dtype)  # [N, out]
    if isinstance(rows, slice):
        out[rows] += delta
    else:
        out.index_add_(0, rows, delta)


def lora_add_segments(
    out: torch.Tensor,  # [T, out], updated
    x: torch.Tensor,  # [T, in]
    segments: list[tuple[Rows, torch.Tensor, torch.Tensor]],
) -> None:
    """`out[rows] += x[rows] @ A^T @ B^T` for each (rows, A [r, in], B [out, r]) in
    `segments`: every adapter of the step, one projection."""
    for rows, a, b in segments:
        lora_expand_add(out, rows, lora_shrink(x, rows, a), b)
