"""Linear layers and embedding lookups over GGUF's block-quantized weights, kept quantized.

`QuantLinear` holds a weight as the file stores it (uint8 [N, K / 32 * block bytes] of Q8_0 or
Q4_0 blocks), usually a zero-copy view of the GGUF file's mapping, and multiplies by it with
`linear_quant_cpu` (the native kernels: activations quantized per row to int8 blocks, as
llama.cpp does), or `linear_quant_torch` where the native library lacks them.

`QuantEmbedding` looks token rows up in a quantized table: it gathers the rows of the step's
tokens and dequantizes those only, never the whole table.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from asyncengine.kernels.quant_cpu import dequantize, linear_quant_cpu, linear_quant_torch


class QuantLinear(nn.Module):
    """`x @ W^T + bias` with W in GGUF blocks (`qtype` "q8_0" or "q4_0"); x [..., K] of the
    engine's dtype, out [..., N] of the same."""

    def __init__(self, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight = qweight  # uint8 [N, K / 32 * block bytes]; may view a file mapping
        self.qtype = qtype
        self.bias = bias
        self.out_features = qweight.shape[0]
        self.in_features = _in_features(qweight, qtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if _native_quant():
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


_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


def _in_features(qweight: torch.Tensor, qtype: str) -> int:
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"unsupported quantization type {qtype!r}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"a {qtype} weight is uint8 [N, bytes], got {qweight.dtype}")
    return qweight.shape[1] // _BLOCK_BYTES[qtype] * 32


@functools.cache
def _native_quant() -> bool:
    """The native library is built and has the quantized kernels."""
    from asyncengine.kernels.cpu_native import load_native

    lib = load_native()
    return lib is not None and hasattr(lib, "linear_q8_0")
