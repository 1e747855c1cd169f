"""LoRA's low-rank add over a batch of row segments, torch reference (Punica's shrink and
expand, the SGMV shape).

A step's packed rows belong to requests for different adapters, and to none. The base
projection runs once for every row; then, per adapter, its rows' `x @ A^T` (the shrink, to the
adapter's rank r) and `@ B^T` (the expand, back to the projection's width), scaled, are added
to those rows of the output. Projections that read the same input (q, k and v; gate and up)
shrink once, with their A matrices stacked. The products run in the adapter's dtype (fp32) and
are rounded to the output's dtype once, when added. These functions are the reference of the
native kernel (`csrc/lora.c`, bound below as `lora_add_native`), which the fused decode call
(`csrc/decode_layers.c`) runs after each group of projections.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, NativeKernels

# csrc/ae_kernels.h's enum ae_lora_field's length, and its enum ae_lora_group in order: the
# native descriptors (`lora_descriptor`) and their tables of one adapter, [layers][groups].
LORA_FIELDS = 12
LORA_GROUPS = ("qkv", "o_proj", "gate_up", "down_proj")

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


def lora_descriptor(
    a: torch.Tensor,  # [R, in] the group's parts' lora_A stacked, fp32 or bf16, contiguous
    parts: list[tuple[torch.Tensor, int] | None],  # per part: (B^T [r, width], first row of A)
) -> list[int]:
    """csrc/lora.c's descriptor (LORA_FIELDS int64) of one adapter's group of projections;
    the tensors must outlive its use. A part that is None is not adapted."""
    fields = [a.data_ptr(), a.shape[0], DTYPE_CODES[a.dtype]]
    for part in (*parts, *[None] * (3 - len(parts))):
        if part is None:
            fields += [0, 0, 0]
            continue
        bt, lo = part
        assert bt.dtype == a.dtype and bt.is_contiguous() and lo + bt.shape[0] <= a.shape[0]
        fields += [bt.data_ptr(), lo, bt.shape[0]]
    return fields


def lora_add_native(
    lib: NativeKernels,
    out: torch.Tensor,  # [T, N] fp32 or bf16 (rows of any stride), updated
    x: torch.Tensor,  # [T, in], out's dtype, rows of any stride
    parts: list[tuple[int, int]],  # each part's (first column, width) in out
    rows: torch.Tensor,  # [M] int64: the segments' rows, segment by segment
    seg_rows: torch.Tensor,  # [S + 1] int64: segment s is rows[seg_rows[s]:seg_rows[s + 1]]
    descs: torch.Tensor,  # [S] int64: the address of each segment's descriptor
    desc_offset: int = 0,  # in int64, from each address
) -> None:
    """The native `lora_add_segments` (csrc/lora.c's ae_lora_add): each segment's low-rank
    product added to its rows of `out`, on torch's thread count."""
    assert out.dtype == x.dtype and out.stride(-1) == 1 and x.stride(-1) == 1
    assert rows.dtype == seg_rows.dtype == descs.dtype == torch.int64
    cols = torch.tensor([c for c, _ in parts], dtype=torch.int64)
    widths = torch.tensor([w for _, w in parts], dtype=torch.int64)
    status = lib.lora_add(
        DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
        x.shape[1], len(parts), cols.data_ptr(), widths.data_ptr(),
        rows.data_ptr(), seg_rows.data_ptr(), descs.numel(), descs.data_ptr(), desc_offset,
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise (MemoryError if status == -1 else ValueError)(f"ae_lora_add: status {status}")
