"""Greedy sampling's argmax on CPU: the native kernel (`csrc/argmax.c`).

torch's CPU argmax is a scalar loop, and an fp32 copy of 64 x 32000 half-precision logits
costs about 1 ms; this reads bf16/fp16/fp32 rows as they are, 16 lanes at a time.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, as_rows, require_native


def argmax_cpu(x: torch.Tensor) -> torch.Tensor:  # x [B, V] -> [B] int64
    """`x.argmax(dim=-1)`: the first index of each row's maximum (or of its first NaN)."""
    return argmax_nan_rows(x)[0]


def argmax_nan_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`argmax_cpu(x)`, and how many of x's rows hold a NaN (found in the same pass)."""
    rows = as_rows(x)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    nan_rows = require_native().argmax_rows(
        DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1],
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out, nan_rows
