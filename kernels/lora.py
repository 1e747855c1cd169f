"""LoRA's low-rank add over a batch of row segments, torch reference (Punica's SGMV shape).

A step's packed rows belong to requests for different adapters, and to none. The base
projection runs once for every row; then, per adapter, its rows' `x @ A^T` (the shrink, to the
adapter's rank r) and `@ B^T` (the expand, back to the projection's width), scaled, are added
to those rows of the output. A native CPU kernel is a later step: this is its reference.
"""

from __future__ import annotations

import torch


def lora_shrink_expand(
    x: torch.Tensor,  # [N, in] the adapter's rows of the projection's input
    a: torch.Tensor,  # [r, in] lora_A
    b: torch.Tensor,  # [out, r] lora_B, already times the adapter's scale
) -> torch.Tensor:  # [N, out]
    """The low-rank product `x @ A^T @ B^T` (B holds the scale): one adapter's delta."""
    return (x @ a.t()) @ b.t()


def lora_add_segments(
    out: torch.Tensor,  # [T, out] the base product of every row (a 2-D view is fine), updated
    x: torch.Tensor,  # [T, in]
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> None:
    """`out[rows] += x[rows] @ A^T @ B^T` for each (rows [N] int64, A [r, in], B [out, r])
    in `segments`: every adapter of the step, its rows gathered (an adapter's rows need not
    be contiguous). In place; rows in no segment are left as they are."""
    for rows, a, b in segments:
        delta = lora_shrink_expand(x.index_select(0, rows), a, b)  # [N, out]
        out.index_add_(0, rows, delta.to(out.dtype))
