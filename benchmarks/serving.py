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

    python benchmarks/serving.py --http [--model a] [--concurrency 64]

`--http` measures the HTTP layer instead: the same load (default: 64 concurrent streams)
through `AsyncLLM` directly (`process`) against `http`: a real `asyncengine serve` process (its
engine core in another) driven by an aiohttp load generator in this child, every request a
streamed `/v1/completions` with `stream_options.continuous_usage_stats` (which gives the token
count of each chunk, so TTFT and ITL are measured as for `process`). Prefix caching is off in
both: the server has no endpoint to reset it between waves. The table gives the HTTP path's
share of the direct path's tokens/s. The load generator shares the machine's cores with the
server and its engine core, so its own cost counts against the HTTP path.
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
KINDS = ("offline", "process", "thread", "http")
MAX_NUM_SEQS = 256


def _requests(folder: Path, concurrency: int) -> list[list[int]]:
    vocab_size, specials = model_vocab(folder)
    return make_workload(vocab_size, specials, num_requests=max(concurrency, 4)).prompts


def _engine_kwargs(dtype: str, prefix_caching: bool = True) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(dtype=dtype, max_num_seqs=MAX_NUM_SEQS)
    if not prefix_caching:
        kwargs["enable_prefix_caching"] = False
    return kwargs


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


def _child_async(
    folder: Path, concurrencies: list[int], dtype: str, core: str, prefix_caching: bool = True
) -> dict[str, Any]:
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
        engine = AsyncLLM.from_pretrained(
            folder, core=core, **_engine_kwargs(dtype, prefix_caching)
        )
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


def _child_http(folder: Path, concurrencies: list[int], dtype: str) -> dict[str, Any]:
    """`asyncengine serve` in a subprocess, driven by aiohttp clients from this process."""
    import re
    import signal
    import tempfile

    import psutil

    cmd = [sys.executable, "-m", "asyncengine.entrypoints.cli", "serve", str(folder)]
    cmd += ["--port", "0", "--no-access-log", "--dtype", dtype]
    cmd += ["--max-num-seqs", str(MAX_NUM_SEQS), "--no-enable-prefix-caching"]
    with tempfile.TemporaryFile("w+b") as log:
        start = time.perf_counter()
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = None
            while url is None:
                if server.poll() is not None or time.perf_counter() - start > 300:
                    log.seek(0)
                    raise RuntimeError(f"serve failed:\n{log.read().decode()[-4000:]}")
                log.seek(0)
                m = re.search(rb"Uvicorn running on (http://[\d.:]+)", log.read())
                url = m.group(1).decode() if m else None
                time.sleep(0.02)
            result = _http_load(url, folder, concurrencies, start)
            tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(True)]
            result["client_rss_mb"] = psutil.Process(server.pid).memory_info().rss / 2**20
            result["tree_rss_mb"] = sum(p.memory_info().rss for p in tree) / 2**20
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(30)
    return result


def _http_load(url: str, folder: Path, concurrencies: list[int], start: float) -> dict[str, Any]:
    import asyncio

    import aiohttp
    import msgspec

    decode = msgspec.json.Decoder().decode
    result: dict[str, Any] = {"runs": {}}

    async def one(
        session: aiohttp.ClientSession, prompt: list[int], rec: dict[str, list[float]]
    ) -> int:
        body = {
            "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }  # fmt: skip
        submitted = last = time.perf_counter()
        n = 0
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            pending = b""
            # Whole reads rather than line by line: a light client leaves the CPU to the server.
            async for data in response.content.iter_any():
                *events, pending = (pending + data).split(b"\n\n")
                now = time.perf_counter()
                for ev in events:
                    if ev == b"data: [DONE]":
                        continue
                    usage = decode(ev[6:]).get("usage")
                    k = usage["completion_tokens"] - n if usage else 0
                    if k:  # the same bookkeeping as _child_async's
                        if n == 0:
                            rec["ttft"].append(now - submitted)
                        else:
                            rec["itl"].extend([(now - last) / k] * k)
                        last = now
                        n += k
        return n

    async def run_wave(
        session: aiohttp.ClientSession, prompts: list[list[int]], c: int
    ) -> dict[str, Any]:
        rec: dict[str, list[float]] = {"ttft": [], "itl": []}
        counts: list[int] = []

        async def worker(chunk: list[list[int]]) -> None:
            for p in chunk:
                counts.append(await one(session, p, rec))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(prompts[i::c]) for i in range(c)))
        seconds = time.perf_counter() - t0
        return {
            "seconds": seconds,
            "tokens": sum(counts),
            "ttft_p50_ms": 1e3 * percentile(rec["ttft"], 50),
            "ttft_p99_ms": 1e3 * percentile(rec["ttft"], 99),
            "itl_p50_ms": 1e3 * percentile(rec["itl"], 50),
            "itl_p99_ms": 1e3 * percentile(rec["itl"], 99),
        }

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while True:  # the server listens before the engine is ready only in theory
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        break
                await asyncio.sleep(0.05)
            result["ready_s"] = time.perf_counter() - start
            warm = warmup_workload_for_model(folder).prompts
            await run_wave(session, warm, len(warm))
            for c in concurrencies:
                result["runs"][str(c)] = await run_wave(session, _requests(folder, c), c)

    try:  # the load generator stands for clients on other machines: keep its cost low
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
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
    if args.concurrency is None:
        args.concurrency = "64" if args.http else "1,16,64,256"
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.child:
        if args.child == "offline":
            record = _child_offline(folder, concurrencies, args.dtype)
        elif args.child == "http":
            record = _child_http(folder, concurrencies, args.dtype)
        else:
            record = _child_async(
                folder, concurrencies, args.dtype, args.child, not args.no_prefix_caching
            )
        print(RESULT_PREFIX + json.dumps(record), flush=True)
        return 0

    import_s = _import_time()
    results: dict[str, dict[str, Any]] = {}
    kinds = ["offline", *args.cores.split(",")]
    if args.http:  # interleaved rounds, so a burst of load on the machine hits both paths
        kinds = [f"{kind}/{r}" for r in range(args.rounds) for kind in ("process", "http")]
    for name in [k.strip() for k in kinds if k.strip()]:
        kind = name.split("/")[0]
        print(f"[{args.model}] {name} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--child", kind, "--concurrency", args.concurrency]
        cmd += ["--dtype", args.dtype, "--model-dir", str(folder)]
        if args.http:  # the server cannot reset its prefix cache between waves: off in both
            cmd.append("--no-prefix-caching")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
        if proc.returncode != 0 or not lines:
            print(proc.stderr[-4000:], file=sys.stderr)
            sys.exit(f"{kind} failed (exit {proc.returncode})")
        results[name] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    table = render_http(results, concurrencies) if args.http else render(results, concurrencies)
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


def render_http(results: dict[str, dict[str, Any]], concurrencies: list[int]) -> str:
    """One row per path and round (results are keyed "process/0", "http/0", ...), then the
    median of each path's rounds and the HTTP path's share of the direct one's tokens/s."""
    header = (
        "| path | round | concurrency | output tok/s | vs direct | TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | ready s | front-end RSS MB | tree RSS MB |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    names = {"process": "AsyncLLM (direct)", "http": "HTTP (asyncengine serve)"}
    for c in concurrencies:
        rates: dict[str, list[float]] = {"process": [], "http": []}
        for key, rec in results.items():
            kind, round_ = key.split("/")
            run = rec["runs"][str(c)]
            rates[kind].append(run["tokens"] / run["seconds"])
            base = results[f"process/{round_}"]["runs"][str(c)]
            ratio = rates[kind][-1] / (base["tokens"] / base["seconds"])
            lines.append(
                f"| {names[kind]} | {round_} | {c} | {rates[kind][-1]:.0f} | {ratio:.2f}x "
                f"| {run['ttft_p50_ms']:.0f} / {run['ttft_p99_ms']:.0f} "
                f"| {run['itl_p50_ms']:.1f} / {run['itl_p99_ms']:.1f} | {rec['ready_s']:.2f} "
                f"| {rec['client_rss_mb']:.0f} | {rec['tree_rss_mb']:.0f} |"
            )
        direct, http = (percentile(rates[k], 50) for k in ("process", "http"))
        lines.append(
            f"| **median** | | {c} | {direct:.0f} / {http:.0f} | **{http / direct:.2f}x** "
            "| | | | | |"
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
    parser.add_argument("--concurrency", help="default: 1,16,64,256; 64 with --http")
    parser.add_argument(
        "--http",
        action="store_true",
        help="the HTTP server (asyncengine serve) against AsyncLLM directly, same load",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="with --http: interleaved rounds (default: 3)"
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cores", default="process,thread")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
