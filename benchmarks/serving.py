"""Serving: streamed output tokens/s through AsyncLLM against the same engine's offline LLM.

    python benchmarks/serving.py [--model a|b|c] [--concurrency 1,16,64,256]
                                 [--cores process,thread] [--json out.json]

For every concurrency C the requests are the benchmark workload's prompts (benchmarks/workload.py:
32–128 random tokens, 64 greedy output tokens, EOS ignored, bf16), C of them (4 for C = 1, run
one after another), always C in flight. Each engine runs in its own fresh subprocess (this
script with `--child KIND`):

- `offline`: `LLM.generate` on the same requests, C at a time (one batch per wave);
- `process` / `thread`: `AsyncLLM.from_pretrained(core=KIND)`, every request streamed with
  DELTA outputs; it records time to ready (from `from_pretrained` to the end of `async with`'s
  start-up), TTFT and inter-token latency per request, and the resident memory (RSS) of the
  client process and of its whole process tree (client + engine core) at the end.

The parent prints a markdown table: tok/s, the ratio to offline at the same concurrency, TTFT
and ITL p50/p99, ready time and memory. Torch threads stay at the machine default everywhere.

The HTTP server's cost over this in-process path is measured by the peers harness, which
runs asyncengine's AsyncLLM and `asyncengine serve` under one HTTP load generator in one run:
`python -m benchmarks.peers --engines asyncengine --modes async,serve --model b`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import ModelUnavailable, describe, model_dir
from benchmarks.workload import (
    make_workload,
    model_vocab,
    percentile,
    warmup_workload_for_model,
)

RESULT_PREFIX = "SERVING_RESULT "
KINDS = ("offline", "process", "thread")
MAX_NUM_SEQS = 256


def _requests(folder: Path, concurrency: int) -> list[list[int]]:
    vocab_size, specials = model_vocab(folder)
    return make_workload(vocab_size, specials, num_requests=max(concurrency, 4)).prompts


def _engine_kwargs(dtype: str) -> dict[str, Any]:
    return dict(dtype=dtype, max_num_seqs=MAX_NUM_SEQS)


def _rss_mb(tree: bool) -> float:
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)] if tree else [me]
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # a process that just exited
            total += p.memory_info().rss
    return total / 2**20


# --------------------------------------------------------------------------------------------
# Children
# --------------------------------------------------------------------------------------------


def _child_offline(folder: Path, concurrencies: list[int], dtype: str) -> dict[str, Any]:
    from asyncengine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(folder, **_engine_kwargs(dtype))
    ready = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    warm = warmup_workload_for_model(folder).prompts
    llm.generate(warm, params, use_tqdm=False)
    runs = {}
    for c in concurrencies:
        prompts = _requests(folder, c)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        tokens = 0
        for i in range(0, len(prompts), c):
            for out in llm.generate(prompts[i : i + c], params, use_tqdm=False):
                tokens += len(out.outputs[0].token_ids)
        runs[str(c)] = {"seconds": time.perf_counter() - t0, "tokens": tokens}
    return {"ready_s": ready, "runs": runs, "client_rss_mb": _rss_mb(False)}


def _child_async(folder: Path, concurrencies: list[int], dtype: str, core: str) -> dict[str, Any]:
    import anyio

    from asyncengine import AsyncLLM, RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    result: dict[str, Any] = {"runs": {}}

    async def one(engine: AsyncLLM, prompt: list[int], rec: dict[str, list[float]]) -> int:
        submitted = last = time.perf_counter()
        first = True
        n = 0
        async for out in engine.generate(prompt, params):
            now = time.perf_counter()
            k = len(out.outputs[0].token_ids)
            if k:
                if first:
                    rec["ttft"].append(now - submitted)
                    first = False
                else:  # a merged DELTA output carries k tokens: k gaps of equal share
                    rec["itl"].extend([(now - last) / k] * k)
                last = now
                n += k
        return n

    async def run_wave(engine: AsyncLLM, prompts: list[list[int]], c: int) -> dict[str, Any]:
        rec: dict[str, list[float]] = {"ttft": [], "itl": []}
        tokens = 0

        async def worker(chunk: list[list[int]]) -> None:
            nonlocal tokens
            for p in chunk:
                n = await one(engine, p, rec)  # not `tokens += await ...`: that loses updates
                tokens += n

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(c):  # C workers, each taking every C-th request: C in flight
                tg.start_soon(worker, prompts[i::c])
        seconds = time.perf_counter() - t0
        return {
            "seconds": seconds,
            "tokens": tokens,
            "ttft_p50_ms": 1e3 * percentile(rec["ttft"], 50),
            "ttft_p99_ms": 1e3 * percentile(rec["ttft"], 99),
            "itl_p50_ms": 1e3 * percentile(rec["itl"], 50),
            "itl_p99_ms": 1e3 * percentile(rec["itl"], 99),
        }

    async def main() -> None:
        start = time.perf_counter()
        engine = AsyncLLM.from_pretrained(folder, core=core, **_engine_kwargs(dtype))
        async with engine:
            result["ready_s"] = time.perf_counter() - start
            warm = warmup_workload_for_model(folder).prompts
            await run_wave(engine, warm, len(warm))
            for c in concurrencies:
                await engine.reset_prefix_cache()
                result["runs"][str(c)] = await run_wave(engine, _requests(folder, c), c)
            result["client_rss_mb"] = _rss_mb(False)
            result["tree_rss_mb"] = _rss_mb(True)

    anyio.run(main)
    return result


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    folder = Path(args.model_dir) if args.model_dir else None
    if folder is None:
        try:
            folder = model_dir(args.model)
        except ModelUnavailable as exc:
            sys.exit(f"model {args.model} ({describe(args.model)}) unavailable: {exc}")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.child:
        if args.child == "offline":
            record = _child_offline(folder, concurrencies, args.dtype)
        else:
            record = _child_async(folder, concurrencies, args.dtype, args.child)
        print(RESULT_PREFIX + json.dumps(record), flush=True)
        return 0

    import_s = _import_time()
    results: dict[str, dict[str, Any]] = {}
    kinds = ["offline", *args.cores.split(",")]
    for kind in [k.strip() for k in kinds if k.strip()]:
        print(f"[{args.model}] {kind} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--child", kind, "--concurrency", args.concurrency]
        cmd += ["--dtype", args.dtype, "--model-dir", str(folder)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
        if proc.returncode != 0 or not lines:
            print(proc.stderr[-4000:], file=sys.stderr)
            sys.exit(f"{kind} failed (exit {proc.returncode})")
        results[kind] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    table = render(results, concurrencies)
    print(f"model {args.model}: {describe(args.model)}; `import asyncengine`: {import_s:.3f} s\n")
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"import_s": import_s, "results": results}, indent=1))
    return 0


def render(results: dict[str, dict[str, Any]], concurrencies: list[int]) -> str:
    header = (
        "| engine | concurrency | output tok/s | vs offline | TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | ready s | client RSS MB | tree RSS MB |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    offline = results["offline"]
    for kind, rec in results.items():
        for c in concurrencies:
            run = rec["runs"][str(c)]
            rate = run["tokens"] / run["seconds"]
            base = offline["runs"][str(c)]
            ratio = rate / (base["tokens"] / base["seconds"])
            lat = (
                f"{run['ttft_p50_ms']:.0f} / {run['ttft_p99_ms']:.0f}"
                if "ttft_p50_ms" in run
                else ""
            )
            itl = (
                f"{run['itl_p50_ms']:.1f} / {run['itl_p99_ms']:.1f}" if "itl_p50_ms" in run else ""
            )
            tree = f"{rec['tree_rss_mb']:.0f}" if "tree_rss_mb" in rec else ""
            lines.append(
                f"| {kind} | {c} | {rate:.0f} | {ratio:.2f}x | {lat} | {itl} | "
                f"{rec['ready_s']:.2f} | {rec['client_rss_mb']:.0f} | {tree} |"
            )
    return "\n".join(lines)


def _import_time() -> float:
    code = (
        "import time; t = time.perf_counter(); import asyncengine; print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="a", choices=("a", "b", "c"))
    parser.add_argument("--model-dir", help="a model folder instead of --model")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--cores", default="process,thread")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
