"""A gated MLP's activation, `silu(gate) * up`, on CPU: the native kernel (`csrc/activation.c`).

One pass instead of two torch ops, rounding where torch rounds: silu in fp32, rounded to the
dtype, times `up`, rounded again (bf16 bit for bit transformers').
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, as_rows, require_native


def silu_mul_cpu(
    gate: torch.Tensor,  # [..., N], rows of unit stride
    up: torch.Tensor,  # [..., N], gate's dtype
) -> torch.Tensor:  # [..., N]
    """`silu(gate) * up`, as a new tensor."""
    n = gate.shape[-1]
    g, u = as_rows(gate), as_rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    require_native().silu_mul(
        DTYPE_CODES[gate.dtype], g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0),
        out.data_ptr(), n, g.shape[0], n, torch.get_num_threads(),
    )  # fmt: skip
    return out
