"""RMSNorm with an optional fused residual add: the torch reference.

`rms_norm_torch(x, weight, eps)` returns `weight * normalize(x)` over the rows of `x`, as a new
tensor. With a `residual`, it first adds `x` into `residual` (in place, as the next layer's
residual) and normalizes that sum: the `hidden = residual + hidden; residual = hidden; hidden =
norm(hidden)` step of a pre-norm decoder layer, in one call. `x` itself is never modified.

The arithmetic follows transformers' `LlamaRMSNorm`: the mean square in fp32, the normalized
row rounded to the input dtype before the weight multiplies it. The same contract, with the
same signature: `rms_norm_triton` (CUDA), `rms_norm_cpu` (the native CPU kernels).
"""

from __future__ import annotations

import torch


def rms_norm_torch(
    x: torch.Tensor,  # [..., N]; not modified
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., N]: residual += x first, then norm(residual)
) -> torch.Tensor:  # [..., N] like x
    """Torch reference: the RMS-normalized rows of `x` (of the sum, after the residual add)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()  # [..., N]
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)
