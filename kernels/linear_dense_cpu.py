"""bf16 linear layers over plain row-major weights, for CPUs without AVX512-BF16 (AVX2 and FMA:
AMD Zen 2/3, Intel before Cooper Lake): the native kernel `csrc/linear_dense.c`.

There, oneDNN has no bf16 path and torch's bf16 GEMM falls back to loops at a sixth of its
fp32 speed. The kernel keeps the weight in bf16 (as loaded: no copy) and computes in fp32 with
FMAs, one rounding to bf16 at the end, so its results match `F.linear`'s up to the order of
the fp32 sums (a last-bit difference in rare values).

Products of GEMM_MIN_ROWS rows or more (prefill chunks) run torch's fp32 GEMM instead, on fp32
copies of x and of the weight made per call (in slices of at most GEMM_SLICE_BYTES): a real
GEMM's register blocking beats this kernel's once the weights are reused across enough rows
(SmolLM2's 30 layers on 2 Zen 3 cores: 126-130 against 73-75 GFLOP/s at 256 and 512 rows; at
96 rows the two are level), and the widening costs a fraction of the product. Same arithmetic:
fp32 products and sums, one rounding to bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.kernels.cpu_native import NativeKernels, load_native

GEMM_MIN_ROWS = 128
GEMM_SLICE_BYTES = 8 << 20  # fp32 weight copied at a time: the lm_head's would be ~110 MB


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
    """`F.linear(x, weight, bias)` by the native kernel (see the module docstring)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    n, k = weight.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    if rows >= GEMM_MIN_ROWS:
        xf = x.float()
        step = max(1, GEMM_SLICE_BYTES // (4 * k))
        for n0 in range(0, n, step):
            part = None if bias is None else bias[n0 : n0 + step].float()
            out[:, n0 : n0 + step] = F.linear(xf, weight[n0 : n0 + step].float(), part)
        return out
    status = lib.linear_bf16_dense(
        x.data_ptr(), x.stride(0), rows, weight.data_ptr(), n, k,
        None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"linear_bf16_dense: no memory for a [{rows}, {k}] fp32 scratch")
    return out
