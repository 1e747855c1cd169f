"""Where a decode step's time goes on a GPU: torch.profiler and cProfile over an offline run.

    python benchmarks/gpu_profile.py [--model qwen2.5-0.5b-shapes] [--seqs 1,64] [--eager]

For each batch size: an `LLM` (engine core in this process) on a random-weight model of real
shapes, warmed up, then `--new` greedy tokens per sequence under torch.profiler. Printed:

- per decode step: wall time, GPU busy time (the sum of kernel times), and the host-side
  synchronisations (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize) and
  copies (cudaMemcpyAsync) the CUDA runtime saw, with graph launches: a graph-replayed decode
  step should show one launch and one synchronisation (the sampled ids' copy to the host);
- the top GPU kernels and the top CPU operators by self time;
- the top Python functions by own time (cProfile, a second run): the engine's host overhead.

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_engine import SHAPES

_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _runtime_counts(prof: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in prof.key_averages():
        name = event.key
        if name in (*_SYNCS, "cudaMemcpyAsync", "cudaGraphLaunch", "cudaLaunchKernel"):
            counts[name] = counts.get(name, 0) + event.count
        elif name == "cuLaunchKernel" or name.startswith("cuLaunchKernelEx"):
            counts["cuLaunchKernel"] = counts.get("cuLaunchKernel", 0) + event.count
    return counts


def _gpu_busy_us(prof: Any) -> float:
    total = 0.0
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total += event.self_device_time_total
    return total


def profile(model: Path, seqs: int, new: int, prompt: int, eager: bool) -> None:
    from asyncengine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model,
        device="cuda",
        dtype="bfloat16",
        attention_backend="triton",
        enforce_eager=eager,
        kv_cache_memory_bytes=4 << 30,
        max_model_len=1024,
    )
    print(f"start-up: {time.perf_counter() - start:.1f} s (load, profile, graphs)", flush=True)
    try:
        generator = torch.Generator().manual_seed(1)
        prompts = torch.randint(10, 5000, (seqs, prompt), generator=generator)
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        llm.generate((prompts + 1).tolist(), params, use_tqdm=False)  # warm-up
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        start = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            llm.generate(prompts.tolist(), params, use_tqdm=False)
        wall = time.perf_counter() - start
        counts = _runtime_counts(prof)
        steps = new  # one prefill step, then new - 1 decode steps, per wave
        busy = _gpu_busy_us(prof)
        label = f"seqs={seqs} {'eager' if eager else 'graphs'}"
        print(f"\n## {label}: {seqs * new / wall:.1f} tok/s under the profiler", flush=True)
        print(
            f"per step: wall {wall / steps * 1e3:.2f} ms, GPU busy {busy / steps / 1e3:.2f} ms; "
            + ", ".join(f"{k} {v / steps:.1f}" for k, v in sorted(counts.items())),
            flush=True,
        )
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        # The host's Python: a second run under cProfile (the profiler's own cost aside).
        pr = cProfile.Profile()
        start = time.perf_counter()
        pr.enable()
        llm.generate((prompts + 2).tolist(), params, use_tqdm=False)
        pr.disable()
        wall = time.perf_counter() - start
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(f"cProfile ({seqs * new / wall:.1f} tok/s under it), by own time:")
        print("\n".join(out.getvalue().splitlines()[:45]), flush=True)
    finally:
        llm.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b-shapes", choices=sorted(SHAPES))
    parser.add_argument("--seqs", default="1,64")
    parser.add_argument("--prompt", type=int, default=80)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA device here; nothing to measure", file=sys.stderr)
        return 0
    from asyncengine.testing import build_tiny_model

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    arch, overrides = SHAPES[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / args.model, arch, dtype="bfloat16", **overrides)
        for n in (int(s) for s in args.seqs.split(",")):
            profile(model, n, args.new, args.prompt, args.eager)
    return 0


if __name__ == "__main__":
    sys.exit(main())
