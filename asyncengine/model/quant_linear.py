"""Linear layers and embedding lookups over GGUF's block-quantized weights, kept quantized.

`QuantLinear` holds a weight as the file stores it (uint8 [N, K / values * block bytes] of one
of `quant_formats.FORMATS`), usually a zero-copy view of the GGUF file's mapping, and
multiplies by it with `linear_quant_cpu` (the native kernels: activations quantized per row to
int8 blocks of 32, as llama.cpp does), or `linear_quant_torch` (the same numbers over the
dequantized weight) where the native library is missing or does not run the format.

`int8_linear` quantizes a float weight at load (`quantization="int8"`): per output channel,
symmetric, onto the same Q8_0 kernels.

`QuantEmbedding` looks token rows up in a quantized table: it gathers the rows of the step's
tokens and dequantizes those only, never the whole table.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from asyncengine.kernels.quant_cpu import linear_quant_cpu, linear_quant_torch, native_formats
from asyncengine.kernels.quant_formats import dequantize, in_features


class QuantLinear(nn.Module):
    """`x @ W^T + bias` with W in GGUF blocks of format `qtype` ("q8_0", "q4_k", ...);
    x [..., K] of the engine's dtype, out [..., N] of the same."""

    def __init__(self, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight = qweight  # uint8 [N, K / values * block bytes]; may view a file mapping
        self.qtype = qtype
        self.bias = bias
        self.out_features = qweight.shape[0]
        self.in_features = in_features(qweight, qtype)
        self.native = qtype in _native_formats()  # else the torch reference runs it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.native:
            return linear_quant_cpu(x, self.qweight, self.qtype, self.bias)
        return linear_quant_torch(x, self.qweight, self.qtype, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}"


def quantize_int8_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (K a multiple of 32) quantized per output channel, symmetric: row n's
    scale s_n = max|w_n| / 127 (rounded to fp16), q = round(w / s_n) in [-127, 127]; returned
    as Q8_0 blocks (uint8 [N, K / 32 * 34]) whose fp16 scales are all s_n, so that the Q8_0
    kernels run it."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"K={k} is not a multiple of 32")
    w = weight.float()
    scale = (w.abs().amax(1, keepdim=True) / 127).half()  # [N, 1]
    s = scale.float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = torch.round(w * inv).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    scales = scale.view(torch.uint8).view(n, 1, 2).expand(n, k // 32, 2)
    return torch.cat([scales, q.view(n, k // 32, 32)], dim=-1).reshape(n, -1)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear | None:
    """A `QuantLinear` of `weight` [N, K] quantized by `quantize_int8_per_channel`; None
    where K is not a multiple of 32 (the layer stays as it is)."""
    if weight.shape[1] % 32:
        return None
    return QuantLinear(quantize_int8_per_channel(weight), "q8_0", bias)


class QuantEmbedding:
    """`rows(ids) -> [T, hidden]`: the dequantized rows of `ids` in a quantized table."""

    def __init__(self, qweight: torch.Tensor, qtype: str, dtype: torch.dtype) -> None:
        self.qweight, self.qtype, self.dtype = qweight, qtype, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        rows = self.qweight.index_select(0, ids)  # [T, row bytes]: only the step's tokens
        return dequantize(rows, self.qtype).to(self.dtype)


@functools.cache
def _native_formats() -> tuple[str, ...]:
    """The formats the native library runs (none where it is not built)."""
    from asyncengine.kernels.cpu_native import load_native

    return native_formats() if load_native() is not None else ()
