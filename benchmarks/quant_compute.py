"""The quantized kernels' compute speed: one weight that stays in the cache, the native product
(`ae_linear_quant`) called in a tight loop, so that the memory's bandwidth (which drifts on a
shared machine) leaves the figure alone. For A/B runs of a kernel change.

    python benchmarks/quant_compute.py [--formats q8_0,q4_k,q6_k] [--rows 1] [--shape 2048x2048]
                                       [--threads 1] [--calls 3000] [--rounds 5]
                                       [--gemm-f32 default|on|off]

Prints, per format, the best of `--rounds` mean call times over `--calls` calls, as ns per 64
weight values and GB/s of weight bytes. A 2048 x 2048 weight is 2.4-4.5 MB (in the last-level
cache); `--gemm-f32` sets the AVX2 path's fp32 product of many-row Q8_0 products
(`quant_cpu.set_gemm_f32`). One call costs about a microsecond of fixed work (quantizing the
row) beside ~100 us of product. On AMD Zen 4 (one thread, 2026-11-28) this gave +-0.5% between
runs where Python-level timings of the same products (benchmarks/quant_kernels.py) moved 30%.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="q8_0,q4_0,q5_0,q4_k,q5_k,q6_k")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--shape", default="2048x2048", help="N x K (out x in)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gemm-f32", choices=("default", "on", "off"), default="default")
    args = parser.parse_args()

    from asyncengine.kernels import quant_cpu, quant_formats
    from asyncengine.kernels.cpu_native import DTYPE_CODES, require_native

    lib = require_native()
    quant_cpu.set_gemm_f32({"default": None, "on": True, "off": False}[args.gemm_f32])
    n, k = (int(v) for v in args.shape.split("x"))
    x = torch.randn(args.rows, k).to(torch.bfloat16)
    out = torch.empty(args.rows, n, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    print(f"path {quant_cpu.current_path()}, {args.rows} row(s) x {n} x {k}, "
          f"{args.threads} thread(s), Q8_0 from {quant_cpu.gemm_f32_min_rows('q8_0') or 'no'} "
          "rows in fp32")  # fmt: skip
    for qtype in args.formats.split(","):
        fmt = quant_formats.quant_format(qtype)
        if qtype in quant_formats.LEGACY:
            qweight = quant_cpu.quantize_weight(torch.randn(n, k) * 0.02, qtype)
        else:
            qweight = quant_formats.random_blocks(qtype, n, k, generator)
        call_args = (
            fmt.code, DTYPE_CODES[torch.bfloat16], x.data_ptr(), k, args.rows,
            qweight.data_ptr(), n, k, None, out.data_ptr(), n, args.threads,
        )  # fmt: skip
        for _ in range(20):
            lib.linear_quant(*call_args)
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.calls):
                lib.linear_quant(*call_args)
            best = min(best, (time.perf_counter() - start) / args.calls)
        per64 = best * 1e9 / (args.rows * n * k / 64)
        print(f"{qtype}: {best * 1e6:.1f} us a call, {per64:.3f} ns per 64 values, "
              f"{qweight.numel() / best / 1e9:.1f} GB/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
