"""Structured outputs on CPU: a grammar's token bitmask applied to logits in place, by the
native kernel (`csrc/bitmask.c`): about 10x faster than xgrammar's own CPU kernel on 32 rows of
a 49k vocabulary here, since whole words of allowed (or forbidden) tokens are done at once and
the rows run on every thread."""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, require_native


def apply_bitmask_cpu(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [S, V] (unit stride along V), rows [R] int64 (indices into S), bitmask [R, W]
    int32 (bit t % 32 of word t // 32 set: token t allowed; W >= ceil(V / 32)): every
    disallowed logit of the named rows becomes -inf."""
    assert logits.stride(-1) == 1 and bitmask.is_contiguous() and rows.dtype == torch.int64
    rows = rows.contiguous()
    require_native().apply_bitmask(
        DTYPE_CODES[logits.dtype], logits.data_ptr(), logits.stride(0), rows.data_ptr(),
        rows.numel(), bitmask.data_ptr(), bitmask.shape[1], logits.shape[1],
        torch.get_num_threads(),
    )  # fmt: skip
