"""Linear layers over GGUF's block-quantized weights on CPU: the native kernels
(`csrc/quant_legacy.c` for the blocks of 32, `csrc/quant_kquants.c` for the K-quants, and
`csrc/quant_gemm.c`, `csrc/quant_gemm_avx2.c` and, for Q8_0 on some AVX2 cores,
`csrc/quant_gemm_f32.c` for many rows), a torch reference, and quantizers for tests.

A weight [N, K] is kept as a GGUF file stores it, a uint8 tensor [N, K / values * block bytes]
of whole blocks (the formats: `quant_formats`), so a tensor can be read in place from the
file's mapping.

`linear_quant_cpu(x, qweight, qtype, bias)` is `x @ W^T + bias` as llama.cpp computes it: x's
rows are quantized to int8 with one fp32 scale per 32 values, per 256 for the K-quants
(`activation_group`, `quantize_rows_q8_cpu`: llama.cpp's block_q8_0 and block_q8_K), a weight
block against an activation block is an exact integer dot product times the two scales, and
those are summed in fp32, rounded once to x's dtype. `linear_quant_torch` is the same in torch
over the dequantized weight (the fallback without a C compiler, and the tests' reference);
`quantize_input=False` gives the product of the unquantized x instead.

The kernel's CPU path (`PATHS`: AVX512-VNNI, AVX2, scalar) is the best this build has, unless
`ASYNCENGINE_QUANT_PATH` names another (read when the kernels are first used) or `set_path`
picks one (tests); the paths differ only in the order of the fp32 sums.

`native_formats()` names the formats the native kernels run (the rest run on the torch
reference). `quantize_weight` makes the legacy formats' bytes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
from an fp32 matrix the way ggml's reference quantizers do (round to nearest), for tests;
`dequantize` reads any format back as fp32.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncengine.heap import huge_page_buffer
from asyncengine.kernels.cpu_native import (
    DTYPE_CODES,
    NativeKernels,
    as_rows,
    load_native,
    require_native,
)
from asyncengine.kernels.quant_formats import (
    FORMATS,
    K_QUANTS,
    LEGACY,
    Q4_0,
    Q4_0_R8,
    Q4_1,
    Q4_K,
    Q4_K_R8,
    Q5_0,
    Q5_0_BYTES,
    Q5_0_R8,
    Q5_1,
    Q5_K,
    Q6_K,
    Q6_K_R8,
    Q8_0,
    Q8_0_R8,
    R8_SOURCES,
    dequantize,
    q5_0_to_bytes,
    quant_format,
)

__all__ = [
    "FORMATS", "K_QUANTS", "LEGACY", "PATHS", "Q4_0", "Q4_0_R8", "Q4_1", "Q4_K", "Q4_K_R8", "Q5_0",
    "Q5_0_BYTES", "Q5_0_R8", "Q5_1", "Q5_K", "Q6_K", "Q6_K_R8", "Q8_0", "Q8_0_R8", "QK", "QKK",
    "activation_group", "available_paths", "current_path", "decode_layout", "dequantize",
    "dequantize_cpu", "dequantize_rows_q8", "gemm_min_rows", "linear_quant_cpu",
    "linear_quant_torch", "native_formats", "quant_gemm_cpu", "quantize_rows_q8_cpu",
    "quantize_rows_q8_torch", "quantize_weight", "repack_r8", "set_path", "unpack_r8",
]  # fmt: skip

QK = 32  # values per activation block (and per legacy weight block)
QKK = 256  # values per K-quant super-block, and per activation scale of the K-quant products
# The kernels' CPU paths, by their number in quant_legacy.c.
PATHS = ("scalar", "avx2", "avx512_vnni")
PATH_ENV = "ASYNCENGINE_QUANT_PATH"


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (ties away from zero), which ggml's reference quantizers use."""
    r = torch.round(v)  # ties to even
    tie = (v - torch.trunc(v)).abs() == 0.5
    return torch.where(tie, torch.trunc(v) + torch.sign(v), r)


def quantize_weight(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """`weight` [N, K] (K a multiple of 32) as GGUF `qtype` blocks, one of `LEGACY`: uint8
    [N, K / 32 * block bytes], computed as ggml's `quantize_row_<qtype>_ref` computes them (in
    fp32, in the same order; round to nearest as it rounds)."""
    if qtype not in LEGACY:
        raise ValueError(f"quantize_weight writes {', '.join(LEGACY)}, not {qtype!r}")
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"K={k} is not a multiple of {QK}")
    blocks = weight.float().reshape(n, k // QK, QK)  # [N, nb, 32]
    if qtype == Q8_0:
        d = blocks.abs().amax(-1, keepdim=True) / 127  # [N, nb, 1]
        q = _round_half_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_f16_bytes(d), q], dim=-1).reshape(n, -1)
    if qtype in (Q4_0, Q5_0):
        # the value of largest magnitude (the first such) to -8 (Q5_0: -16); q = w / d + 8
        # (16), the + 0.5 and a truncation rounding it
        half = 8 if qtype == Q4_0 else 16
        peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        d = peak / -half
        q = torch.trunc(blocks * _inverse(d) + (half + 0.5)).clamp(max=2 * half - 1)
        parts = [_f16_bytes(d)]
    else:
        # Q4_1 / Q5_1: from the minimum m to the maximum in 15 (31) steps; q = (w - m) / d
        top = 15 if qtype == Q4_1 else 31
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = (high - low) / top
        q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(max=top)
        parts = [_f16_bytes(d), _f16_bytes(low)]
    q = q.to(torch.uint8)  # [N, nb, 32], each in 0..15 (Q5: 0..31)
    if qtype in (Q5_0, Q5_1):  # qh: bit j is element j's fifth bit, a little-endian uint32
        bits = ((q >> 4) & 1).reshape(n, k // QK, 4, 8)
        weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)
        parts.append((bits * weights).sum(-1, dtype=torch.uint8))
    nib = q & 15
    parts.append(nib[..., : QK // 2] | (nib[..., QK // 2 :] << 4))
    return torch.cat(parts, dim=-1).reshape(n, -1)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, 0 where d is 0 (ggml's `id = d ? 1.0f/d : 0.0f`)."""
    return torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """fp32 [..., 1] as its fp16's two bytes [..., 2], little-endian (as GGML_FP32_TO_FP16)."""
    return v.half().view(torch.uint8)


def activation_group(qtype: str) -> int:
    """How many activation values share one int8 scale in products over `qtype` weights:
    256 for the K-quants (llama.cpp's block_q8_K; Q4_K_R8 too), else 32."""
    return QKK if quant_format(qtype).values == QKK else QK


def quantize_rows_q8_torch(x: torch.Tensor, group: int = QK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernels quantize it: int8 qs [M, K] and fp32 scales [M, K / 32], each
    group of `group` values (32 or 256, see `activation_group`) with d = max|x| / 127 (the
    same d for each block of 32 in it), q = x * (127 / max|x|) rounded to nearest even."""
    m, k = x.shape
    xb = x.float().reshape(m, k // group, group)
    amax = xb.abs().amax(-1, keepdim=True)
    # a tensor divided by a tensor: torch computes `127.0 / amax` as 127 * (1 / amax), which
    # rounds differently from the kernels' one division
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    qs = torch.round((xb * inv).clamp(-127, 127)).to(torch.int8)
    d = (amax / 127).expand(m, k // group, group // QK)
    return qs.reshape(m, k), d.reshape(m, -1)


def dequantize_rows_q8(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The fp32 values [M, K] of quantized activation rows (qs int8 [M, K], d [M, K / 32])."""
    m, k = qs.shape
    return (qs.float().reshape(m, -1, QK) * d.unsqueeze(-1)).reshape(m, k)


def linear_quant_torch(
    x: torch.Tensor,  # [..., K] fp32 / bf16 / fp16
    qweight: torch.Tensor,  # uint8 [N, K / 32 * block bytes]
    qtype: str,
    bias: torch.Tensor | None = None,  # [N]
    *,
    quantize_input: bool = True,
) -> torch.Tensor:  # [..., N], x's dtype
    """`x @ W^T + bias` over the dequantized weight in fp32, with x's rows first quantized as
    the kernels quantize them (`quantize_input=False`: x as it is)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if quantize_input:
        rows = dequantize_rows_q8(*quantize_rows_q8_torch(rows, activation_group(qtype)))
    out = F.linear(rows, dequantize(qweight, qtype), None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


@functools.cache
def _kernels() -> NativeKernels:
    """The native library, with the path of $ASYNCENGINE_QUANT_PATH taken (once)."""
    lib = require_native()
    name = os.environ.get(PATH_ENV, "").strip()
    if name:
        _set_path(lib, name)
    return lib


def native_formats() -> tuple[str, ...]:
    """The formats (of `FORMATS`) the native kernels run in this build."""
    bits = _kernels().quant_formats
    return tuple(name for name, f in FORMATS.items() if bits & (1 << f.code))


def available_paths() -> tuple[str, ...]:
    """The kernels' CPU paths this build has (of `PATHS`), slowest first."""
    bits = _kernels().quant_paths
    return tuple(p for i, p in enumerate(PATHS) if bits & (1 << i))


def set_path(name: str | None) -> str:
    """Take path `name` (one of `available_paths()`; None: the best) from the next call on, in
    this process; returns the path now in effect."""
    return _set_path(_kernels(), name)


def current_path() -> str:
    """The path the kernels take now (of `PATHS`)."""
    return PATHS[_kernels().quant_set_path(-2)]


def gemm_min_rows(qtype: str) -> int:
    """From how many rows `linear_quant_cpu` runs a product over `qtype` weights on the panel
    GEMM (`csrc/quant_gemm.c` on the AVX512-VNNI path, `csrc/quant_gemm_avx2.c` on the AVX2
    path for the file layouts); 0 where it never does (the scalar path)."""
    return int(_kernels().quant_gemm_min_rows(quant_format(qtype).code))


def gemm_f32_min_rows(qtype: str) -> int:
    """From how many rows the panel GEMM multiplies `qtype` weights dequantized to fp32 by
    the activations as they are (not quantized to int8 blocks), on the path in effect: Q8_0
    on the AVX2 path where that is on (`set_gemm_f32`; `csrc/quant_gemm_f32.c`); 0
    elsewhere."""
    return int(_kernels().quant_gemm_f32_min_rows(quant_format(qtype).code))


def set_gemm_f32(on: bool | None) -> bool:
    """Turn the AVX2 path's fp32 product of many-row Q8_0 products on or off for this
    process (None: the CPU's default, on for cores with 128-bit vector units: AMD Zen 1 and
    Zen+); returns whether it is on."""
    return bool(_kernels().quant_gemm_f32_set(-1 if on is None else int(on)))


def _set_path(lib: NativeKernels, name: str | None) -> str:
    if name is not None and name not in PATHS:
        raise ValueError(f"unknown quantized-kernel path {name!r} (one of {', '.join(PATHS)})")
    code = lib.quant_set_path(-1 if name is None else PATHS.index(name))
    if code < 0:
        raise ValueError(f"this build of the native kernels has no {name} path")
    return PATHS[code]


def quantize_rows_q8_cpu(x: torch.Tensor, group: int = QK) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_q8_torch` by the native kernel (the same numbers, bit for bit)."""
    lib = _kernels()
    rows = as_rows(x)
    m, k = rows.shape
    if group not in (QK, QKK):
        raise ValueError(f"the activations' group is {QK} or {QKK} values, not {group}")
    if k % group:
        raise ValueError(f"K={k} is not a multiple of {group}")
    qs = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // QK, dtype=torch.float32)
    args = (
        DTYPE_CODES[rows.dtype], rows.data_ptr(), rows.stride(0), m, k, qs.data_ptr(),
        d.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if group == QK:
        lib.quantize_rows_q8(*args)
    else:
        lib.quantize_rows_q8k(*args)
    return qs, d


def linear_quant_cpu(
    x: torch.Tensor,  # [..., K] fp32 / bf16 / fp16 on CPU, K a multiple of the block's values
    qweight: torch.Tensor,  # uint8 [N, K / values * block bytes], contiguous
    qtype: str,  # one of native_formats()
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:  # [..., N], x's dtype
    """`x @ W^T + bias` by the native kernels (see the module docstring): one row runs as a
    matrix-vector product on the work pool, more rows as tiles that load each weight block
    once for several rows, and from `gemm_min_rows(qtype)` rows (AVX512-VNNI and AVX2) as a
    GEMM over panels of the weight unpacked to bytes."""
    lib = _kernels()
    missing = f"this build's native kernels do not run {qtype} (see native_formats())"
    return _product(
        lambda *args: lib.linear_quant(*args), "linear_quant_cpu", missing, x, qweight, qtype, bias
    )


def quant_gemm_cpu(
    x: torch.Tensor,  # [..., K] fp32 / bf16 / fp16, as linear_quant_cpu's
    qweight: torch.Tensor,  # uint8 [N, K / values * block bytes], contiguous
    qtype: str,  # any of FORMATS
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:  # [..., N], x's dtype
    """`linear_quant_cpu`'s product on the panel GEMM (`csrc/quant_gemm.c`) whatever the rows
    (linear_quant_cpu takes it from `gemm_min_rows(qtype)` rows): for tests and benchmarks. Raises
    ValueError where this build or path has no panel GEMM for it (AVX512-VNNI: every format;
    AVX2: the file layouts)."""
    lib = _kernels()
    missing = f"the native kernels have no panel GEMM for {qtype} on the {current_path()} path"
    return _product(
        lambda *args: lib.quant_gemm(*args), "quant_gemm_cpu", missing, x, qweight, qtype, bias
    )


def _product(
    kernel: Callable[..., int],
    name: str,
    missing: str,  # the error where the kernel says it does not run the format (-3)
    x: torch.Tensor,
    qweight: torch.Tensor,
    qtype: str,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """One of the native quantized products (ae_linear_quant's arguments and returns), the
    arguments checked first."""
    fmt = quant_format(qtype)
    rows = as_rows(x)
    m, k = rows.shape
    n = qweight.shape[0]
    row_bytes = k // fmt.values * fmt.nbytes
    if k % fmt.values or qweight.dtype != torch.uint8 or qweight.shape != (n, row_bytes):
        raise ValueError(
            f"a {qtype} weight for K={k} is uint8 [N, {row_bytes}] (K a multiple of "
            f"{fmt.values}); got {qweight.dtype} {tuple(qweight.shape)}"
        )
    if not qweight.is_contiguous():
        raise ValueError("the quantized weight must be contiguous")
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    out = torch.empty(m, n, dtype=x.dtype)
    status = kernel(
        fmt.code, DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0), m, qweight.data_ptr(),
        n, k, None if bias is None else bias.data_ptr(), out.data_ptr(), n,
        torch.get_num_threads(),
    )  # fmt: skip
    if status == -1:
        raise MemoryError(f"{name}: no memory for [{m}, {k}] int8 activations")
    if status == -2 and qtype in R8_SOURCES and n % 8:
        raise ValueError(f"{name}: a {qtype} weight has a multiple of 8 rows, not {n}")
    if status == -3:
        raise ValueError(missing)
    if status != 0:
        raise ValueError(f"{name}: K={k} is not a multiple of {fmt.values}")
    return out.reshape(*x.shape[:-1], n)


# Q4_K, Q8_0, Q5_0, Q4_0 and Q6_K weights of a multiple of 8 rows are repacked at load into their
# 8-row interleaved formats (csrc/quant_r8.c) where the kernels take the AVX512-VNNI path: their
# one-row products are faster than those over the file's bytes (Zen 4, one thread, from the
# cache: Q4_K 1.6x, Q8_0 2.3x, Q5_0 2.6x, Q4_0 2.3x, Q6_K 1.2x; docs/quantization.md), and the
# panel GEMM reads them as well. Set to False to compare.
REPACK_R8 = True
# On the AVX2 path Q5_0 weights become Q5_0_BYTES at load (quant_formats.q5_0_to_bytes: 34 bytes
# a block for 22): there Q5_0's one-row products are bound by unpacking its fifth bits, and
# Q8_0's tiles read the bytes' blocks 1.5x faster (AMD Zen 1, 2048 x 2048 from the L3, one
# thread: 10.5 -> 7.2 ns per 64 values); the panel GEMM reads them as Q5_0. Set to False to
# compare.
Q5_0_AS_BYTES = True
# the file's formats that have an interleaved layout, and its name
_R8 = {source: r8 for r8, source in R8_SOURCES.items()}


def decode_layout(
    qweight: torch.Tensor, qtype: str, empty: Callable[[int, int], torch.Tensor] | None = None
) -> tuple[torch.Tensor, str]:
    """The weight and its format as the products read them fastest on this machine: Q4_K,
    Q8_0, Q5_0, Q4_0 and Q6_K as a new tensor of their interleaved format (see REPACK_R8;
    written into `empty(n, row_bytes)` where given, e.g. a load's weight arena), anything
    else as it is (the same tensor); on the AVX2 path Q5_0 as Q5_0_BYTES (see
    Q5_0_AS_BYTES)."""
    if load_native() is None:
        return qweight, qtype
    as_bytes = Q5_0_AS_BYTES and current_path() == "avx2"
    if qtype == Q5_0 and as_bytes and Q5_0_BYTES in native_formats():
        return q5_0_to_bytes(qweight), Q5_0_BYTES
    if not REPACK_R8 or qtype not in _R8 or qweight.shape[0] % 8:
        return qweight, qtype
    if current_path() != "avx512_vnni" or _R8[qtype] not in native_formats():
        return qweight, qtype
    return repack_r8(qweight, qtype, empty), _R8[qtype]


def repack_r8(
    qweight: torch.Tensor, qtype: str, empty: Callable[[int, int], torch.Tensor] | None = None
) -> torch.Tensor:
    """Q4_K, Q8_0, Q5_0, Q4_0 or Q6_K weights (`qtype`), uint8 [N, row bytes] with N a multiple
    of 8, in their 8-row interleaved layout (a new tensor of the same shape: `empty(N, row
    bytes)`, written, where given, else `weight_buffer`'s)."""
    out, args = _repack_args(qweight, qtype, empty)
    _repacked(_kernels().repack_r8(quant_format(_R8[qtype]).code, *args))
    return out


def unpack_r8(qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """Weights of an interleaved format (`qtype`: Q4_K_R8, Q8_0_R8, Q5_0_R8, Q4_0_R8, Q6_K_R8)
    back as the file's rows they were made from (a new tensor); as `quant_formats.r8_to_file`,
    natively."""
    out, args = _repack_args(qweight, qtype)
    _repacked(_kernels().unpack_r8(quant_format(qtype).code, *args))
    return out


def _repack_args(
    qweight: torch.Tensor, qtype: str, empty: Callable[[int, int], torch.Tensor] | None = None
) -> tuple[torch.Tensor, tuple[int, int, int, int, int]]:
    """The output of a repack of `qweight` and the native call's arguments after the format
    (source, output, N, K, threads); ValueError if it is not a `qtype` weight (one with an
    interleaved layout, or one of those) of whole blocks and groups of 8 rows."""
    if qtype not in _R8 and qtype not in R8_SOURCES:
        names = ", ".join(s.upper() for s in _R8)
        raise ValueError(f"{qtype} has no 8-row interleaved layout ({names} have)")
    fmt = quant_format(qtype)
    n, row_bytes = qweight.shape
    if (
        qweight.dtype != torch.uint8
        or row_bytes % fmt.nbytes
        or n % 8
        or not qweight.is_contiguous()
    ):
        raise ValueError(
            f"a {qtype} weight to repack is contiguous uint8 [N, K / {fmt.values} * "
            f"{fmt.nbytes}] with N a multiple of 8; got {qweight.dtype} {tuple(qweight.shape)}"
        )
    out = (empty or weight_buffer)(n, row_bytes)
    if out.shape != (n, row_bytes) or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"empty({n}, {row_bytes}) gave {out.dtype} {tuple(out.shape)}")
    k = row_bytes // fmt.nbytes * fmt.values
    return out, (qweight.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())


def weight_buffer(n: int, row_bytes: int) -> torch.Tensor:
    """uint8 [n, row_bytes] for a weight kept as long as the model: on huge pages where the
    system gives them (`heap.huge_page_buffer`)."""
    got = huge_page_buffer(n * row_bytes)
    if got is None:
        return torch.empty(n, row_bytes, dtype=torch.uint8)
    buffer, offset = got
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=n * row_bytes, offset=offset)
    return flat.view(n, row_bytes)


def _repacked(status: int) -> None:
    if status != 0:
        raise ValueError(f"repacking rows failed (status {status})")


def dequantize_cpu(
    qweight: torch.Tensor,  # uint8 [N, K / values * block bytes], contiguous
    qtype: str,  # any of FORMATS
    dtype: torch.dtype,  # fp32, bf16 or fp16
    out: torch.Tensor | None = None,  # [N, K] of `dtype`, rows contiguous: written in place
) -> torch.Tensor:  # [N, K]
    """The weight's values, as `dequantize` gives them rounded once to `dtype`, by the native
    kernels (`csrc/quant_dequant.c`, rows split between torch's threads)."""
    fmt = quant_format(qtype)
    n, row_bytes = qweight.shape
    k = row_bytes // fmt.nbytes * fmt.values
    if qweight.dtype != torch.uint8 or row_bytes % fmt.nbytes or not qweight.is_contiguous():
        raise ValueError(
            f"a {qtype} weight is contiguous uint8 [N, whole {fmt.nbytes}-byte blocks]; got "
            f"{qweight.dtype} {tuple(qweight.shape)}"
        )
    if out is None:
        out = torch.empty(n, k, dtype=dtype)
    elif out.shape != (n, k) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {dtype} [{n}, {k}] with contiguous rows")
    status = _kernels().dequantize_quant(
        fmt.code, qweight.data_ptr(), n, k, DTYPE_CODES[dtype], out.data_ptr(), out.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"dequantize_cpu: {qtype} to {dtype} failed (status {status})")
    return out
