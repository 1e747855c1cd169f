# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Helpers shared by the Triton kernels: interpreter detection, library functions, launches.

Importing a Triton kernel module decides, once, whether its kernels are compiled for the GPU or
run by Triton's interpreter on CPU tensors: `@triton.jit` reads `TRITON_INTERPRET` when it
decorates. `asyncengine.model.attention` sets the variable before it imports the kernels on a
CPU device.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe() -> None:
    pass


# Whether the kernel modules importing this one run under the interpreter.
INTERPRETING = isinstance(_probe, InterpretedFunction)


def _library(fn: Any) -> Any:
    """A `triton.language` library function (itself `@triton.jit`) usable in either mode.

    The library's own `@jit` functions (`tl.sum`, `tl.max`, `tl.zeros`, ...) were decorated
    when triton was first imported; in a process that imported it before TRITON_INTERPRET was
    set (transformers' model modules import triton), they are compiled-mode functions that the
    interpreter refuses to call. Under the interpreter we wrap their Python bodies afresh, which
    keep the interpreter's fast numpy paths for the standard reductions.
    """
    if INTERPRETING and not isinstance(fn, InterpretedFunction):
        return InterpretedFunction(fn.fn)
    return fn


# Kernels call these instead of tl.sum / tl.max (and tl.full instead of tl.zeros).
tl_sum = _library(tl.sum)
tl_max = _library(tl.max)

_ROUND_BF16_FIRST = tl.constexpr(INTERPRETING)


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """`x.to(dtype)`, rounding to nearest even in both modes.

    Compiled Triton rounds fp32 -> bf16 to nearest even; the interpreter truncates. Under the
    interpreter we round the fp32 bits first, so that its truncation is exact.
    """
    if _ROUND_BF16_FIRST and dtype == tl.bfloat16 and x.dtype != tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


# Triton >= 3.9 warns when FMA fusion is left to its default; we want fusion, so say so.
LAUNCH_OPTIONS: dict[str, Any] = {"enable_fp_fusion": True}


def is_interpreted(kernel: object) -> bool:
    """Whether a `@triton.jit` kernel runs under the interpreter (decided at its import)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(kernel: object, tensor: torch.Tensor) -> None:
    """Fail clearly when a kernel meets tensors on a device its mode cannot run on."""
    interpreted = is_interpreted(kernel)
    if interpreted and tensor.device.type != "cpu":
        raise RuntimeError(
            "the Triton kernels were imported under TRITON_INTERPRET=1 and run only on CPU "
            f"tensors, not {tensor.device.type!r} ones"
        )
    if not interpreted and tensor.device.type == "cpu":
        raise RuntimeError(
            "the Triton kernels were imported compiled and need GPU tensors; to run them on CPU, "
            "set TRITON_INTERPRET=1 before asyncengine.kernels' Triton modules are imported"
        )


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
