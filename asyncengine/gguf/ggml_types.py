"""ggml's tensor types: their numbers in a GGUF file, their block layout, and which we serve.

A quantized type stores a row in blocks of `block_size` values, each `block_nbytes` bytes
(scales and packed quants together), so a row of `n` values is `n // block_size` whole blocks
and rows never share a block. The numbers and sizes are llama.cpp's (ggml/include/ggml.h,
ggml/src/ggml-common.h); tests check them against the `gguf` package's table.
"""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    """`enum ggml_type`; the gaps are types llama.cpp has removed."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# (values per block, bytes per block) of the types the engine serves. 256-value types are
# llama.cpp's "K-quants" (super-blocks of QK_K = 256).
BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q8_0: (32, 34),  # f16 scale, 32 x int8
    GGMLType.Q4_0: (32, 18),  # f16 scale, 32 x 4-bit
    GGMLType.Q4_1: (32, 20),  # f16 scale, f16 min, 32 x 4-bit
    GGMLType.Q5_0: (32, 22),  # f16 scale, 32 high bits, 32 x 4-bit
    GGMLType.Q5_1: (32, 24),  # f16 scale, f16 min, 32 high bits, 32 x 4-bit
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
}

SUPPORTED_TYPES: tuple[GGMLType, ...] = tuple(BLOCK_LAYOUT)
FLOAT_TYPES: tuple[GGMLType, ...] = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def type_name(ggml_type: int) -> str:
    """llama.cpp's name of a type number ("Q4_K"), or "type N (unknown)"."""
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"type {ggml_type} (unknown)"


def supported_names() -> str:
    """The types the engine runs, for error messages."""
    return ", ".join(t.name for t in SUPPORTED_TYPES)


def tensor_nbytes(ggml_type: GGMLType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of a served type; `shape` outermost first (its last dim is the row)."""
    block_size, block_nbytes = BLOCK_LAYOUT[ggml_type]
    count = 1
    for dim in shape:
        count *= dim
    return count // block_size * block_nbytes
