"""bf16 linear layers for CPUs without AVX512-BF16 (AVX2 and FMA: AMD Zen 2/3, Intel before
Cooper Lake), over weights packed once at load time: the native kernel `csrc/linear_dense.c`.

There, oneDNN has no bf16 path and torch's bf16 GEMM falls back to loops at a sixth of its
fp32 speed. The kernel keeps the weight in bf16 and computes in fp32 with FMAs, one rounding
to bf16 at the end, so its results match `F.linear`'s up to the order of the fp32 sums (a
last-bit difference in rare values).

`pack_dense` lays a weight [N, K] out as the kernel reads it: panels of PANEL_ROWS rows (the
last padded with zero rows), each k-major, the panel's 16 columns at one k side by side in the
order the kernel widens them (`NativeKernels.dense_panel_order`). A one-row product then
streams each thread's share of the weight as one sequential read, and the GEMM of more rows
needs no per-call repacking. `unpack_dense` gives the plain weight back.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import NativeKernels, load_native

PANEL_ROWS = 16


def dense_kernels() -> NativeKernels | None:
    """The native library where its dense bf16 kernel runs on AVX2 FMAs; else None."""
    lib = load_native()
    return lib if lib is not None and lib.linear_dense_simd else None


def pack_dense(lib: NativeKernels, weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] bf16 in the kernel's layout: [ceil(N / 16), K, 16], a new tensor."""
    n, k = weight.shape
    panels = -(-n // PANEL_ROWS)
    padded = weight.new_zeros(panels * PANEL_ROWS, k)
    padded[:n] = weight
    order = torch.tensor(lib.dense_panel_order)
    # [panels, 16, K] -> [panels, K, 16], then column j moved to slot order[j]
    by_k = padded.view(panels, PANEL_ROWS, k).transpose(1, 2)
    packed = torch.empty(panels, k, PANEL_ROWS, dtype=weight.dtype)
    packed[:, :, order] = by_k
    return packed


def unpack_dense(lib: NativeKernels, packed: torch.Tensor, n: int) -> torch.Tensor:
    """The plain weight [n, K] of `pack_dense`'s output (a copy)."""
    panels, k, _ = packed.shape
    order = torch.tensor(lib.dense_panel_order)
    by_k = packed[:, :, order]  # [panels, K, 16] in column order
    return by_k.transpose(1, 2).reshape(panels * PANEL_ROWS, k)[:n].contiguous()


def linear_bf16_dense(
    lib: NativeKernels,
    x: torch.Tensor,  # [rows, in] bf16, unit stride along in
    packed: torch.Tensor,  # pack_dense(weight [out, in])
    out_features: int,
    bias: torch.Tensor | None,  # [out] bf16
) -> torch.Tensor:  # [rows, out] bf16
    """`F.linear(x, weight, bias)` by the native kernel (see the module docstring)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    status = lib.linear_bf16_dense(
        x.data_ptr(), x.stride(0), rows, packed.data_ptr(), out_features, k,
        None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"linear_bf16_dense: no memory for a [{rows}, {k}] fp32 scratch")
    return out
