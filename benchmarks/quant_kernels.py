"""The quantized linear kernels (kernels/quant_cpu.py) against the bf16 one (linear_cpu.py) on
the same shapes, the weights coming from memory as they do in a decode step: every format the
native build runs (`quant_cpu.native_formats()`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and, once they
land, the K-quants).

    python benchmarks/quant_kernels.py [--rows 1,4,64] [--shapes 2048x8192,8192x2048]
                                       [--repeats 30] [--path avx512_vnni|avx2|scalar]
                                       [--formats q4_0,q4_1] [--bf16 onednn|dense]

Shapes are N x K (out x in). For each shape and row count it times each kind in turn, in
blocks (bf16 `--repeats` times, then Q8_0, ..., and the whole round three times), each call
on the next of several copies of the weight (together over 96 MB, past the last-level
cache), and prints one line per kind: the median ms, the weight bytes per ms as GB/s, and its
speed-up over bf16 in this one run: the machine's bandwidth drifts between runs and under
other load, so compare ratios. Not call by call: the bf16 kernels run on OpenMP teams (oneDNN
or linear_dense_cpu), whose threads spin for a while after each call, and a quantized product
of up to 8 rows, which runs on the kernels' work pool, then shared the cores with them: on
an AVX2 machine's 4-row products that made Q8_0 look 0.53x bf16's speed where it is 0.97x.
The first calls of each block are left out (warm-up). The legacy formats' weights come from
`quantize_weight`, the others' (which no quantizer here writes) from
`quant_formats.random_blocks`: the kernels' speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

ROTATE_BYTES = 96 << 20  # the copies of each weight together: past a 32 MB L3
ROUNDS = 3  # blocks of each kind's calls, in turn
WARMUP = 3  # calls left out at the start of each block


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,64")
    parser.add_argument("--shapes", default="2048x8192,8192x2048")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--path", default=None, help="the quantized kernels' CPU path")
    parser.add_argument("--formats", default=None, help="of native_formats(); default: all")
    parser.add_argument(
        "--bf16",
        choices=("onednn", "dense"),
        default="onednn",
        help="the bf16 kernel to compare with: oneDNN's (linear_cpu), or the engine's own AVX2 "
        "one (linear_dense_cpu), which bf16 models run where oneDNN has no bf16 (AVX2 CPUs)",
    )
    args = parser.parse_args()

    from asyncengine.kernels import quant_cpu, quant_formats
    from asyncengine.kernels.cpu_native import require_native
    from asyncengine.kernels.linear_cpu import LinearCpu, pack_native
    from asyncengine.kernels.linear_dense_cpu import linear_bf16_dense, pack_dense

    lib = require_native()
    path = quant_cpu.set_path(args.path)
    formats = quant_cpu.native_formats()
    if args.formats:
        wanted = args.formats.split(",")
        missing = [f for f in wanted if f not in formats]
        if missing:
            parser.error(f"not run natively here: {', '.join(missing)} (have {formats})")
        formats = tuple(wanted)
    print(f"threads {torch.get_num_threads()}, quantized path {path}, bf16 kernel {args.bf16}, "
          f"bf16 fast path {'yes' if lib.linear_bf16_fast else 'no'}, "
          f"formats {', '.join(formats)}")  # fmt: skip
    print("| N x K | rows | kind | ms | GB/s | bf16 / kind |")
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = torch.randn(n, k) * 0.02
            kinds: dict[str, tuple[int, Callable[[torch.Tensor, int], torch.Tensor]]] = {}
            if args.bf16 == "dense":
                dense = pack_dense(lib, w.to(torch.bfloat16))
                copies = [
                    functools.partial(linear_bf16_dense, lib, packed=dense.clone(),
                                      out_features=n, bias=None)
                    for _ in range(_copies(n * k * 2))
                ]  # fmt: skip
            else:
                packed, packed_k = pack_native(w.to(torch.bfloat16))
                copies = [
                    LinearCpu(lib, packed.clone(), packed_k, (n, k), None)
                    for _ in range(_copies(n * k * 2))
                ]
            kinds["bf16"] = (n * k * 2, _rotating(copies))
            for qtype in formats:
                if qtype in quant_formats.LEGACY:
                    q = quant_cpu.quantize_weight(w, qtype)
                else:
                    q = quant_formats.random_blocks(qtype, n, k, generator)
                qs = [q.clone() for _ in range(_copies(q.numel()))]
                quant = [functools.partial(quant_cpu.linear_quant_cpu, qweight=c, qtype=qtype)
                         for c in qs]  # fmt: skip
                kinds[qtype] = (q.numel(), _rotating(quant))
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k).to(torch.bfloat16)
                times: dict[str, list[float]] = {name: [] for name in kinds}
                block = -(-args.repeats // ROUNDS)
                for _ in range(ROUNDS):
                    for name, (_, fn) in kinds.items():
                        for i in range(block + WARMUP):
                            start = time.perf_counter()
                            fn(x, i)
                            if i >= WARMUP:
                                times[name].append((time.perf_counter() - start) * 1000)
                med = {name: statistics.median(t) for name, t in times.items()}
                for name, (nbytes, _) in kinds.items():
                    print(f"| {n}x{k} | {rows} | {name} | {med[name]:.3f} | "
                          f"{nbytes / med[name] / 1e6:.1f} | "
                          f"{med['bf16'] / med[name]:.2f}x |")  # fmt: skip
    return 0


def _rotating(
    fns: Sequence[Callable[[torch.Tensor], torch.Tensor]],
) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Call i runs fns[i % len(fns)]: each call on the next copy of the weight."""
    return lambda x, i: fns[i % len(fns)](x)


def _copies(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


if __name__ == "__main__":
    sys.exit(main())
