"""bf16 linear layers over plain row-major weights, for CPUs without AVX512-BF16 (AVX2 and FMA:
AMD Zen 2/3, Intel before Cooper Lake): the native kernels `csrc/linear_dense.c` (one row, and
4 or 8) and `csrc/gemm_dense.c` (every other row count), which the first routes to.

There, oneDNN has no bf16 path and torch's bf16 GEMM falls back to loops at a sixth of its
fp32 speed. The kernels keep the weight in bf16 (as loaded: no copy) and compute in fp32 with
FMAs, one rounding to bf16 at the end, so their results match `F.linear`'s up to the order of
the fp32 sums (a last-bit difference in rare values). The register-blocked GEMM also beats
torch's fp32 GEMM on widened copies at every row count measured (up to 1024), so prefill
chunks stay here too.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import NativeKernels, load_native


def dense_kernels() -> NativeKernels | None:
    """The native library where its dense bf16 kernel runs on AVX2 FMAs; else None."""
    lib = load_native()
    return lib if lib is not None and lib.linear_dense_simd else None


def linear_bf16_dense(
    lib: NativeKernels,
    x: torch.Tensor,  # [rows, in] bf16, unit stride along in
    weight: torch.Tensor,  # [out, in] bf16, contiguous
    bias: torch.Tensor | None,  # [out] bf16
) -> torch.Tensor:  # [rows, out] bf16
    """`F.linear(x, weight, bias)` by the native kernels (see the module docstring)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    n, k = weight.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    status = lib.linear_bf16_dense(
        x.data_ptr(), x.stride(0), rows, weight.data_ptr(), n, k,
        None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"linear_bf16_dense: no memory for a [{rows}, {k}] fp32 scratch")
    return out
