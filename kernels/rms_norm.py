"""RMSNorm with an optional fused residual add, in place: the torch reference.

`rms_norm_torch(x, weight, eps)` replaces each row of `x` by `weight * normalize(x)`. With a
`residual`, it first adds `x` into `residual` (in place, as the next layer's residual) and then
normalizes that sum into `x`: the `hidden = residual + hidden; residual = hidden; hidden =
norm(hidden)` step of a pre-norm decoder layer, in one call.

The arithmetic follows transformers' `LlamaRMSNorm`: the mean square in fp32, the normalized
row rounded to the input dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch


def rms_norm_torch(
    x: torch.Tensor,  # [T, N], normalized in place
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]: residual += x first, then x = norm(residual)
) -> None:
    """Torch reference: RMS-normalize the rows of `x` in place (after the residual add)."""
    if residual is not None:
        residual.add_(x)
        x.copy_(residual)
    xf = x.float()  # [T, N]
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x.copy_(weight * normed.to(x.dtype))
