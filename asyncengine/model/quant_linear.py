"""Linear layers and embedding lookups over GGUF's block-quantized weights, kept quantized.

`QuantLinear` holds a weight as the file stores it (uint8 [N, K / values * block bytes] of one
of `quant_formats.FORMATS`), usually a zero-copy view of the GGUF file's mapping, and
multiplies by it with `linear_quant_cpu` (the native kernels: activations quantized per row to
int8 blocks of 32, as llama.cpp does), or `linear_quant_torch` (the same numbers over the
dequantized weight) where the native library is missing or does not run the format.

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
        self._native = qtype in _native_formats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self._native:
            return linear_quant_cpu(x, self.qweight, self.qtype, self.bias)
        return linear_quant_torch(x, self.qweight, self.qtype, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}"


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
