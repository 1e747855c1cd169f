"""A model's linear layers on CPU: oneDNN's bf16 products against the native kernel
(kernels/linear_cpu.py, which PackedLinear routes products of up to NATIVE_MAX_ROWS rows to).

    python benchmarks/cpu_linears.py [--model a|b|c] [--rows 1,16,64,128] [--repeats 5]

Loads the model as the engine does (bf16, packed weights) and times one pass through all its
linear layers and the lm_head, in layer order, at each row count: the weights come from memory
as they do in a step, not from cache. For each row count it alternates the two paths
(`cpu_linear.NATIVE_MAX_ROWS` set to 0 for oneDNN) `--repeats` times in this one process, as
the machine's memory bandwidth drifts between processes, and prints the median of each and
their ratio. Without the native kernel's fast path (no AVX512-BF16) both columns time the same
layers (on AVX2 machines, `NativeDenseLinear`'s dense kernel over its packed panels). On CPUs
with AMX, PackedLinear routes at most `NATIVE_MAX_ROWS_AMX` rows to the native kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.models import MODEL_NAMES, model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="b", choices=MODEL_NAMES)
    parser.add_argument("--rows", default="1,16,64,128")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from asyncengine import LLM
    from asyncengine.model import cpu_linear

    llm = LLM(str(model_dir(args.model)), dtype="bfloat16")
    try:
        executor: Any = llm.engine.engine_core.executor  # the in-process (uniproc) executor
        forward = executor.worker.model_runner.model
        if not hasattr(forward, "linear_layers"):
            print("this model does not run the lean CPU forward: nothing to time")
            return 1
        layers = forward.linear_layers()
        native_max = cpu_linear.NATIVE_MAX_ROWS
        print(f"{len(layers)} linear layers, native kernel up to {native_max} rows")
        print("| rows | oneDNN ms | native ms | native / oneDNN |\n|---|---|---|---|")
        with torch.inference_mode():
            for rows in (int(r) for r in args.rows.split(",")):
                widths = {m.in_features for m in layers}
                inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in widths}
                times: dict[int, list[float]] = {0: [], native_max: []}
                for _ in range(args.repeats):
                    for limit in times:
                        cpu_linear.NATIVE_MAX_ROWS = limit
                        start = time.perf_counter()
                        for layer in layers:
                            layer(inputs[layer.in_features])
                        times[limit].append((time.perf_counter() - start) * 1000)
                cpu_linear.NATIVE_MAX_ROWS = native_max
                onednn, native = (statistics.median(times[k]) for k in (0, native_max))
                print(f"| {rows} | {onednn:.2f} | {native:.2f} | {native / onednn:.2f}x |")
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
