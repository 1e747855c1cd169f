"""Data parallel on one machine: DP=2 against DP=1, and prefix-aware against load routing.

    python benchmarks/data_parallel.py [--model b --model c] [--repeats 2] [--json out.json]

Two measurements, each configuration a fresh AsyncLLM (its cores fresh processes), repeats
alternating between the configurations so that drift hits both alike:

1. `dp`: the benchmark workload (benchmarks/workload.py: 64 requests of 32–128 random tokens,
   64 greedy output tokens, bf16), all 64 streamed at once, through DP=2 with one compute
   thread per rank (`num_threads=1`) against DP=1 with two. Output tokens/s, TTFT and ITL p50.
2. `routing`: a shared-prefix chat workload on DP=2 (model b only, by default): 8 groups of 8
   requests, each group's requests sharing a 256-token system prompt and each ending in its
   own 16-token question, 32 output tokens; the groups arrive one after another, each group's
   8 at once, 4 groups in flight. Prefix-cache hit rate (over both ranks) and TTFT p50,
   `data_parallel_routing="prefix"` against `"load"`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio

from benchmarks.models import describe, model_dir
from benchmarks.workload import DTYPE, median, model_vocab, percentile, workload_for_model

_KV_BYTES = 512 * 2**20


async def _stream(engine: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one streamed greedy request."""
    from asyncengine import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    start = time.perf_counter()
    first = last = 0.0
    gaps: list[float] = []
    async for out in engine.generate(prompt, params):
        now = time.perf_counter()
        n = len(out.outputs[0].token_ids)
        if not n:
            continue
        if not first:
            first = now
        else:
            gaps.extend([(now - last) / n] * n)
        last = now
    return first - start, gaps


async def _run_dp(model: Path, dp: int, threads: int) -> dict[str, float]:
    from asyncengine import AsyncLLM

    workload = workload_for_model(model)
    kw = dict(dtype=DTYPE, kv_cache_memory_bytes=_KV_BYTES // dp, max_num_seqs=256)
    async with AsyncLLM.from_pretrained(
        model, data_parallel_size=dp, num_threads=threads, data_parallel_routing="load", **kw
    ) as engine:
        await _stream(engine, workload.prompts[0][:16], 4)  # warm-up
        await engine.reset_prefix_cache()
        ttfts: list[float] = []
        gaps: list[float] = []

        async def one(prompt: list[int]) -> None:
            ttft, g = await _stream(engine, prompt, workload.output_len)
            ttfts.append(ttft)
            gaps.extend(g)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt in workload.prompts:
                tg.start_soon(one, prompt)
        elapsed = time.perf_counter() - start
    return {
        "tok_s": workload.num_output_tokens / elapsed,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
    }


def _chat_workload(model: Path) -> list[list[list[int]]]:
    vocab, specials = model_vocab(model)
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(vocab)
            if t not in specials:
                out.append(t)
        return out

    groups = []
    for _ in range(8):
        system = tokens(256)
        groups.append([system + tokens(16) for _ in range(8)])
    return groups


async def _run_routing(model: Path, routing: str) -> dict[str, float]:
    from asyncengine import AsyncLLM

    groups = _chat_workload(model)
    kw = dict(dtype=DTYPE, kv_cache_memory_bytes=_KV_BYTES // 2, max_num_seqs=256)
    async with AsyncLLM.from_pretrained(
        model, data_parallel_size=2, num_threads=1, data_parallel_routing=routing, **kw
    ) as engine:
        await _stream(engine, [1, 2, 3, 4], 2)  # warm-up
        await engine.reset_prefix_cache()
        before = await engine.statistics()
        ttfts: list[float] = []
        slots = anyio.Semaphore(4)

        async def group(prompts: list[list[int]]) -> None:
            async with slots, anyio.create_task_group() as tg:
                for prompt in prompts:
                    tg.start_soon(one, prompt)

        async def one(prompt: list[int]) -> None:
            ttft, _ = await _stream(engine, prompt, 32)
            ttfts.append(ttft)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompts in groups:
                tg.start_soon(group, prompts)
                await anyio.sleep(0.05)  # groups arrive one after another
        elapsed = time.perf_counter() - start
        after = await engine.statistics()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "tok_s": 64 * 32 / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", choices=("a", "b", "c"))
    parser.add_argument("--routing-model", default="b", choices=("a", "b", "c"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    models = args.model or ["b", "c"]
    results: dict[str, Any] = {"dp": {}, "routing": {}}

    for name in models:
        path = model_dir(name)
        runs: dict[str, list[dict[str, float]]] = {"DP=1 x 2 threads": [], "DP=2 x 1 thread": []}
        for _ in range(args.repeats):
            runs["DP=1 x 2 threads"].append(anyio.run(_run_dp, path, 1, 2))
            runs["DP=2 x 1 thread"].append(anyio.run(_run_dp, path, 2, 1))
        results["dp"][name] = {k: _medians(v) for k, v in runs.items()}
        print(f"\n### model {name}: {describe(name)}, 64 streams\n")
        _print_table(results["dp"][name], ("tok_s", "ttft_p50_ms", "itl_p50_ms"))

    path = model_dir(args.routing_model)
    routing_runs: dict[str, list[dict[str, float]]] = {"prefix": [], "load": []}
    for _ in range(args.repeats):
        for routing in ("prefix", "load"):
            routing_runs[routing].append(anyio.run(_run_routing, path, routing))
    results["routing"] = {k: _medians(v) for k, v in routing_runs.items()}
    print(f"\n### routing, DP=2, model {args.routing_model}: shared 256-token prefixes\n")
    _print_table(results["routing"], ("hit_rate", "ttft_p50_ms", "tok_s"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: median([r[key] for r in runs]) for key in runs[0]}


def _print_table(rows: dict[str, dict[str, float]], keys: tuple[str, ...]) -> None:
    print("| config | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for label, row in rows.items():
        print(f"| {label} | " + " | ".join(f"{row[k]:.3g}" for k in keys) + " |")


if __name__ == "__main__":
    sys.exit(main())
