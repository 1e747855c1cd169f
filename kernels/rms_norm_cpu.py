"""RMSNorm with an optional fused residual add, on CPU: the native kernels (`csrc/norms.c`).

Same contract as `rms_norm_torch` (see `rms_norm.py`), in one pass instead of seven torch ops
(eight with the residual add): the arithmetic and roundings of transformers' `LlamaRMSNorm`,
so bf16 outputs are bit for bit transformers', fp32 ones differ by summation order only.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, as_rows, require_native


def rms_norm_cpu(
    x: torch.Tensor,  # [..., N], rows of unit stride; not modified
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., N]: residual += x first, then norm(residual)
) -> torch.Tensor:  # [..., N] like x
    """`weight * (x * rsqrt(mean(x^2) + eps))` over the last dim, as a new tensor; with
    `residual`, of `residual + x`, which is first stored into `residual` (in place, rounded to
    its dtype; its rows must be contiguous, any row stride). One dtype for all."""
    rows, n = as_rows(x), x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype)
    w = weight.contiguous()
    if residual is None:
        require_native().rms_norm(
            DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0), out.data_ptr(), n,
            w.data_ptr(), rows.shape[0], n, eps, torch.get_num_threads(),
        )  # fmt: skip
        return out
    res = residual.view(-1, n)
    if res.stride(-1) != 1:
        raise ValueError("rms_norm_cpu: the residual's rows must be contiguous")
    require_native().add_rms_norm(
        DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0), res.data_ptr(), res.stride(0),
        out.data_ptr(), n, w.data_ptr(), rows.shape[0], n, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out
