"""Compile every Triton kernel, as its wrapper launches it, for NVIDIA GPUs, with no GPU.

    python tests/kernels/compile_for_cuda.py [--arch 80 --arch 90]

Run in a process without TRITON_INTERPRET. Each wrapper is called on `meta` tensors with its
kernels swapped for recorders; every recorded launch (grid aside) is then compiled with
`triton.compile` down to a cubin for each architecture, and its shared memory checked against
that architecture's limit. Prints one line per launch and exits non-zero on the first failure.
This catches what the interpreter cannot: code the compiler rejects, and tiles too large.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Shared memory per block (opt-in maximum) by compute capability.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
_TRITON_DTYPE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


@dataclass
class Launch:
    kernel: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class Recorder:
    def __init__(self, kernel: Any, launches: list[Launch]) -> None:
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, args, kwargs))

        return record


def _signature(launch: Launch) -> tuple[dict[str, str], dict[str, Any]]:
    names = launch.kernel.arg_names
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name, arg in zip(names, launch.args, strict=False):
        if isinstance(arg, torch.Tensor):
            signature[name] = "*" + _TRITON_DTYPE[arg.dtype]
        elif isinstance(arg, bool):
            signature[name] = "i1"
        elif isinstance(arg, int):
            signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
        elif isinstance(arg, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {arg!r}")
    for name in names[len(launch.args) :]:
        signature[name] = "constexpr"
        constexprs[name] = launch.kwargs[name]
    return signature, constexprs


def record_launches() -> list[Launch]:
    """Call every wrapper on meta tensors over the shapes that matter; return the launches."""
    from asyncengine.kernels import (
        paged_attention_triton,
        reshape_and_cache_triton,
        rms_norm_triton,
    )

    launches: list[Launch] = []
    for module, names in (
        (paged_attention_triton, ("_decode_kernel", "_reduce_splits_kernel", "_prefill_kernel")),
        (reshape_and_cache_triton, ("_reshape_and_cache_kernel",)),
        (rms_norm_triton, ("_rms_norm_kernel",)),
    ):
        for name in names:
            setattr(module, name, Recorder(getattr(module, name), launches))
    meta = torch.device("meta")

    # Attention: (dtype, H_q, H_kv, D, block_size) at its extremes of tile size.
    for dtype, num_q_heads, num_kv_heads, head_dim, block_size in (
        (torch.bfloat16, 32, 8, 128, 16),
        (torch.float16, 8, 8, 64, 32),
        (torch.float32, 16, 2, 256, 16),
        (torch.bfloat16, 16, 1, 256, 32),
    ):
        cache = torch.empty(2, num_kv_heads, 64, block_size, head_dim, dtype=dtype, device=meta)
        block_table = torch.empty(3, 8, dtype=torch.int64, device=meta)
        plan = paged_attention_triton.plan_paged_attention_triton(
            [0, 1, 2, 40], [100, 1000, 60], block_table, block_size, dtype
        )
        query = torch.empty(40, num_q_heads, head_dim, dtype=dtype, device=meta)
        key = torch.empty(40, num_kv_heads, head_dim, dtype=dtype, device=meta)
        for splits in (1, 4):
            plan.num_splits = splits
            paged_attention_triton.paged_attention_triton(query, key, key, cache, plan, 0.1)
        reshape_and_cache_triton.reshape_and_cache_triton(
            key, key, cache, torch.empty(40, dtype=torch.int64, device=meta)
        )
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty(7, 4096, dtype=dtype, device=meta)
        residual = torch.empty(7, 4096, dtype=dtype, device=meta)
        rms_norm_triton.rms_norm_triton(
            x, torch.empty(4096, dtype=dtype, device=meta), 1e-6, residual
        )
        rms_norm_triton.rms_norm_triton(x, torch.empty(4096, dtype=dtype, device=meta), 1e-6)
    return launches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", choices=sorted(SMEM_LIMIT))
    archs = parser.parse_args().arch or [80, 90]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    seen: set[str] = set()
    for launch in record_launches():
        signature, constexprs = _signature(launch)
        options = {k: launch.kwargs[k] for k in _OPTIONS if k in launch.kwargs}
        key = repr((launch.kernel.fn.__name__, signature, constexprs, options))
        if key in seen:
            continue
        seen.add(key)
        for arch in archs:
            source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs)
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            shared = compiled.metadata.shared
            ok = shared <= SMEM_LIMIT[arch]
            print(
                f"sm_{arch} {launch.kernel.fn.__name__} {constexprs} {options} "
                f"shared={shared} {'ok' if ok else 'OVER LIMIT'}"
            )
            if not ok:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
