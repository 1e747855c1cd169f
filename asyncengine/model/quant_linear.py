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
import threading

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.kernels.quant_cpu import (
    decode_layout,
    dequantize_cpu,
    gemm_min_rows,
    linear_quant_cpu,
    linear_quant_torch,
    native_formats,
)
from asyncengine.kernels.quant_formats import dequantize, in_features, quant_format
from asyncengine.model.weight_arena import WeightArena


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
        # Many-row products may dequantize it (see DEQUANT_MIN_ROWS), unless it is huge.
        self.dequant = self.out_features * self.in_features <= DEQUANT_MAX_VALUES
        self.dequant_min_rows = dequant_min_rows(qtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if not self.native:
            return linear_quant_torch(x, self.qweight, self.qtype, self.bias)
        rows = x.numel() // self.in_features
        if (
            self.dequant
            and rows >= self.dequant_min_rows
            and not 0 < gemm_min_rows(self.qtype) <= rows
        ):
            # Many rows: the weight dequantized into a scratch buffer, then the float GEMM.
            return self._dequantized_product(x)
        return linear_quant_cpu(x, self.qweight, self.qtype, self.bias)

    def _dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + bias over W dequantized, DEQUANT_CHUNK_BYTES of it at a time: a chunk is
        read back by the GEMM from the cache it was just written to, where a whole weight of
        a 1B model (up to 64 MB in bf16) went out to memory and back."""
        n, k = self.out_features, self.in_features
        bias = None if self.bias is None else self.bias.to(x.dtype)
        # whole groups of 8 rows (the interleaved formats slice so)
        rows = max(64, DEQUANT_CHUNK_BYTES // (k * x.element_size())) // 8 * 8
        if rows >= n:
            weight = dequantize_cpu(self.qweight, self.qtype, x.dtype, _scratch(x.dtype, n, k))
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, k)
        out = torch.empty(flat.shape[0], n, dtype=x.dtype)
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            chunk = _scratch(x.dtype, n1 - n0, k)
            weight = dequantize_cpu(self.qweight[n0:n1], self.qtype, x.dtype, chunk)
            out[:, n0:n1] = F.linear(flat, weight, None if bias is None else bias[n0:n1])
        return out.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}"


# Where the kernels' path has no panel GEMM (`gemm_min_rows(qtype)` is 0: the scalar path),
# products of at least this many rows dequantize the weight (once per product, into a scratch
# buffer of at most DEQUANT_CHUNK_BYTES at a time, never kept) and run torch's float GEMM on
# it: there the GEMM's speed outweighs a pass over the weight, while the int8 tiles pay a
# scale product per block and row. Fewer rows (decode of a few streams) read the blocks in
# place with the activations quantized to int8, as llama.cpp does. The two give slightly
# different sums (no int8 rounding of the activations here), so a request's numbers depend on
# how many rows its step had, as with any GEMM. Where the two crossed, measured on AVX512-VNNI
# Zen 4 before the panel GEMM (one thread, SmolLM2's and Llama-3.2-1B's shapes): 14-16 rows
# for the blocks of 32 (Q8_0, Q5_0), 33-36 for the K-quants, whose int8 kernels do more per
# byte of weight. On the AVX512-VNNI and AVX2 paths, from `gemm_min_rows(qtype)` rows the int8
# panel GEMM takes them instead (csrc/quant_gemm.c: 1.4-2.5x faster than dequantizing, Zen 4,
# Llama-3.2-1B's shapes, 9 to 256 rows; csrc/quant_gemm_avx2.c: level with dequantizing into
# an AVX512-BF16 GEMM on the same Zen 4, so faster where there is none), and nothing
# dequantizes.
DEQUANT_MIN_ROWS_BY_BLOCK = {32: 16, 256: 32}
# From this many rows every format dequantizes.
DEQUANT_MIN_ROWS = max(DEQUANT_MIN_ROWS_BY_BLOCK.values())


def dequant_min_rows(qtype: str) -> int:
    """The fewest rows of a product over `qtype` blocks that dequantize the weight."""
    return DEQUANT_MIN_ROWS_BY_BLOCK[quant_format(qtype).values]


# A weight of more values always runs on the int8 kernels (a 1B model's 128k-token lm_head,
# tied to its embedding, is 262M values; 2^25 takes every other projection of such a model).
# The limit kept a whole dequantized weight out of memory (0.5 GB for that lm_head); since
# products dequantize in chunks it no longer does, and whether such a weight is faster on
# the GEMM in chunks is not yet measured.
DEQUANT_MAX_VALUES = 1 << 25

# A many-row product over a weight larger than this dequantizes and multiplies it in chunks of
# rows this size, each read back by the GEMM from the cache it was just written to. Measured on
# Zen 4 (1 MB of L2 per core, 32 MB of L3), Llama-3.2-1B's shapes in Q8_0, 16 streams with
# 80-token prompts: whole weights 51 tok/s; chunks of 1 MB 47, 2 MB 64, 4 MB 65, 8 MB 64-72,
# 16 MB 58.
DEQUANT_CHUNK_BYTES = 8 << 20
_SCRATCH = threading.local()  # one buffer per thread (in-process engines may run side by side)


def _scratch(dtype: torch.dtype, n: int, k: int) -> torch.Tensor:
    """A [n, k] `dtype` view of this thread's scratch buffer, grown to fit (never shrunk: the
    largest weight or chunk of a model, once)."""
    need = n * k
    buffer: torch.Tensor | None = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < need:
        buffer = _SCRATCH.buffer = torch.empty(need, dtype=dtype)
    return buffer[:need].view(n, k)


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


def int8_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, arena: WeightArena | None = None
) -> QuantLinear | None:
    """A `QuantLinear` of `weight` [N, K] quantized by `quantize_int8_per_channel` (in the
    layout the products read fastest here: `decode_layout`; its blocks in `arena` where
    given); None where K is not a multiple of 32 (the layer stays as it is)."""
    if weight.shape[1] % 32:
        return None
    empty = None if arena is None else arena.empty
    qweight, qtype = decode_layout(quantize_int8_per_channel(weight), "q8_0", empty)
    return QuantLinear(qweight if arena is None else arena.keep(qweight), qtype, bias)


# An interleaved table's lookup of more tokens than this dequantizes each group once (sorting
# the ids costs more than the repeats for a decode step's few).
UNIQUE_GROUPS_FROM = 64


class QuantEmbedding:
    """`rows(ids) -> [T, hidden]`: the dequantized rows of `ids` in a quantized table, also
    one of 8 rows interleaved (a tied lm_head's layout: `decode_layout`)."""

    def __init__(self, qweight: torch.Tensor, qtype: str, dtype: torch.dtype) -> None:
        self.qweight, self.qtype, self.dtype = qweight, qtype, dtype
        self.group = quant_format(qtype).row_group  # rows come in groups of this many

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.group == 1:
            return self._dequantize(self.qweight.index_select(0, ids))  # only the step's rows
        # interleaved: the groups holding the step's tokens (each once for long steps: a
        # prefill chunk's would be many times its rows), dequantized, then their rows
        if ids.numel() == 1:  # one stream's decode step: slices, no index ops
            i = int(ids[0])
            start = i - i % self.group
            return self._dequantize(self.qweight[start : start + self.group])[
                i - start : i - start + 1
            ]
        if ids.numel() > UNIQUE_GROUPS_FROM:
            groups, at = torch.unique(ids // self.group, return_inverse=True)
        else:
            groups, at = ids // self.group, torch.arange(ids.numel())
        table = self.qweight.view(-1, self.group * self.qweight.shape[1])
        rows = table.index_select(0, groups).view(-1, self.qweight.shape[1])
        values = self._dequantize(rows)  # [groups * group, hidden]
        return values.index_select(0, at * self.group + ids % self.group)

    def _dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        if _native_formats():  # the same values (one rounding to dtype), without torch's ops
            return dequantize_cpu(rows, self.qtype, self.dtype)  # a Q6_K row: 0.2 ms in torch
        return dequantize(rows, self.qtype).to(self.dtype)


@functools.cache
def _native_formats() -> tuple[str, ...]:
    """The formats the native library runs (none where it is not built)."""
    from asyncengine.kernels.cpu_native import load_native

    return native_formats() if load_native() is not None else ()
