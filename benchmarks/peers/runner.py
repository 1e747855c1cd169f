"""One engine, one model, one mode, in a fresh process: prints one JSON line for the harness.

    python -m benchmarks.peers.runner --engine asyncengine|vllm|transformers
        --mode offline|async|batched --model-dir DIR [--repeats 3] [--concurrency 1,16,64]

Run by the peers harness (`python -m benchmarks.peers`) with each peer's own interpreter (its
virtualenv), from the repository root, so this file
imports nothing of asyncengine at the top: only the standard library, psutil and the pure
Python workload definition. Each engine gets the same workload (benchmarks/workload.py).

- offline: time from constructor to ready, then `--repeats` timed runs of the whole
  workload (output tokens/s of the median run); transformers also reports one request's
  inter-token latency (its streamer), as it has no async engine.
- async: for each concurrency C, C requests in flight (for C = 1: 4 requests one after
  another), every request streamed; output tokens/s, TTFT and inter-token latencies.
- batched (asyncengine only): llama-batched-bench's shape, for the llama.cpp comparison: for
  each batch size B in `--concurrency`, B distinct 80-token prompts generating 64 tokens each,
  output tokens over the wall time (median of `--repeats`), with a KV cache of the largest
  batch's tokens, as llama-batched-bench is given.

Both modes report the resident memory of the whole process tree (engine-core and worker
processes included), sampled at its largest during the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import contextlib
import itertools

from benchmarks.peers.report import CONCURRENCIES
from benchmarks.workload import (
    SEED,
    Workload,
    make_workload,
    median,
    model_vocab,
    percentile,
    warmup_workload_for_model,
    workload_for_model,
)

RESULT_PREFIX = "PEER_RESULT "
C1_REQUESTS = 4  # requests run one after another at concurrency 1


class _RssSampler:
    """The largest resident memory (MB) of this process and its descendants, sampled."""

    def __init__(self, interval: float = 0.2) -> None:
        import psutil

        self._me = psutil.Process()
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def sample(self) -> None:
        import psutil

        total = 0
        for proc in [self._me, *self._me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        self.peak_mb = max(self.peak_mb, total / 2**20)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sample()

    def stop(self) -> float:
        self.sample()
        self._stop.set()
        return self.peak_mb


def _stream_stats(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """tok/s, TTFT and inter-token latency percentiles (ms) of streamed requests."""
    ttft = [r["ttft"] * 1000 for r in records]
    itl = [gap * 1000 for r in records for gap in r["gaps"]]
    tokens = sum(r["tokens"] for r in records)
    stats: dict[str, Any] = {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall}
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl)):
        if values:
            stats[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
    return stats


# ---- asyncengine --------------------------------------------------------------------------


def _import_torch() -> None:
    """Import torch before the offline ready clock starts, as every peer's runner does: `import
    vllm` and the transformers runner import it before their constructors, while asyncengine's
    LLM imports it lazily inside its own, so without this only asyncengine's time to ready would
    carry torch's import (~0.8 s here)."""
    import torch  # noqa: F401


# A GGUF file asyncengine's runs load in place of the model folder (--weights); the folder
# still gives the workload its vocabulary.
_WEIGHTS: Path | None = None


def _model(folder: Path) -> str:
    """What asyncengine loads: the --weights file, else the folder."""
    return str(_WEIGHTS or folder)


def _asyncengine_offline(folder: Path, wl: Workload, repeats: int) -> dict[str, Any]:
    from asyncengine import LLM, SamplingParams

    _import_torch()

    start = time.perf_counter()
    llm = LLM(_model(folder), dtype=wl.dtype)
    ready = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=wl.output_len, ignore_eos=True)
    llm.generate(_warmup(folder), params, use_tqdm=False)

    def run() -> None:
        llm.reset_prefix_cache()  # every repeat prefills, as the first did
        llm.generate(wl.prompts, params, use_tqdm=False)

    seconds = _timed(run, repeats)
    llm.shutdown()
    return {"ready_s": ready, "offline_seconds": seconds}


# llama-batched-bench's shape, which the llama.cpp comparison uses offline: B sequences, each an
# 80-token prompt of its own, 64 output tokens; output tokens over the wall time of the batch
# (its prefill included).
BATCHED_PROMPT_LEN = 80
BATCHED_GEN_LEN = 64


def batched_prompts(folder: Path, batch: int) -> list[list[int]]:
    """`batch` distinct prompts of BATCHED_PROMPT_LEN random ids of the model's vocabulary."""
    vocab_size, specials = model_vocab(folder)
    return make_workload(
        vocab_size,
        specials,
        num_requests=batch,
        min_prompt_len=BATCHED_PROMPT_LEN,
        max_prompt_len=BATCHED_PROMPT_LEN,
        seed=SEED + 2 + batch,
    ).prompts


# KV blocks of the engine's default size (16 tokens) per sequence of the batched shape.
_BATCHED_BLOCKS_PER_SEQ = -(-(BATCHED_PROMPT_LEN + BATCHED_GEN_LEN) // 16)


def _asyncengine_batched(folder: Path, batches: list[int], repeats: int) -> dict[str, Any]:
    from asyncengine import LLM, SamplingParams

    _import_torch()
    # The KV cache of llama-batched-bench's runs (the harness gives it the cells of the
    # largest batch it runs, whichever batch this run is), and a spare block a sequence: the
    # CPU default (256 MB) holds fewer than 64 such sequences of a 1B model (32 KB a token),
    # and the scheduler then preempts some.
    num_kv_blocks = max(*batches, *CONCURRENCIES) * (_BATCHED_BLOCKS_PER_SEQ + 1)
    llm = LLM(_model(folder), dtype="bfloat16", num_kv_blocks=num_kv_blocks)
    params = SamplingParams(temperature=0, max_tokens=BATCHED_GEN_LEN, ignore_eos=True)
    llm.generate(_warmup(folder), params, use_tqdm=False)
    tok_s: dict[str, float] = {}
    for batch in batches:
        prompts = batched_prompts(folder, batch)

        def run(prompts: list[list[int]] = prompts) -> None:
            llm.reset_prefix_cache()
            llm.generate(prompts, params, use_tqdm=False)

        tok_s[str(batch)] = batch * BATCHED_GEN_LEN / median(_timed(run, repeats))
    llm.shutdown()
    return {"batched": tok_s}


# asyncengine's serving settings: shortest prompt first (aged by arrival; see
# asyncengine/sched/request_queue.py). Everything else is the default.
ASYNCENGINE_SERVING: dict[str, Any] = {"scheduling_policy": "sjf"}


def _asyncengine_async(folder: Path, wl: Workload, concurrencies: list[int]) -> dict[str, Any]:
    import anyio

    from asyncengine import AsyncLLM, RequestOutputKind, SamplingParams

    # No _import_torch() here: AsyncLLM's own process never imports torch (its engine-core
    # process does, inside the constructor, as vLLM's does), and importing it here would add
    # ~200 MB to the tree's resident memory. Time to ready is reported from offline runs.
    params = SamplingParams(
        temperature=0,
        max_tokens=wl.output_len,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    results: dict[str, Any] = {}

    async def main() -> None:
        start = time.perf_counter()
        async with AsyncLLM.from_pretrained(
            _model(folder), dtype=wl.dtype, **ASYNCENGINE_SERVING
        ) as engine:
            results["ready_s"] = time.perf_counter() - start

            async def one(prompt: list[int]) -> dict[str, Any]:
                return await _consume(
                    engine.generate(prompt, params), lambda o: len(o.outputs[0].token_ids)
                )

            await _one_wave(one, _warmup(folder), 8)
            for c in concurrencies:
                await engine.reset_prefix_cache()
                results[str(c)] = await _measure_wave(one, workload_for_model(folder, wave=c), c)

    anyio.run(main)
    return results


# ---- vLLM ---------------------------------------------------------------------------------


def _vllm_settings() -> dict[str, Any]:
    return {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 2048, "seed": 0}


def _vllm_offline(folder: Path, wl: Workload, repeats: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=str(folder), **_vllm_settings())
    ready = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=wl.output_len, ignore_eos=True)
    prompts: Any = [{"prompt_token_ids": p} for p in wl.prompts]
    llm.generate([{"prompt_token_ids": p} for p in _warmup(folder)], params, use_tqdm=False)

    def run() -> None:
        llm.reset_prefix_cache()
        llm.generate(prompts, params, use_tqdm=False)

    return {"ready_s": ready, "offline_seconds": _timed(run, repeats)}


def _vllm_async(folder: Path, wl: Workload, concurrencies: list[int]) -> dict[str, Any]:
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    params = SamplingParams(
        temperature=0,
        max_tokens=wl.output_len,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    results: dict[str, Any] = {}
    counter = iter(range(10**9))

    async def main() -> None:
        start = time.perf_counter()
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(folder), **_vllm_settings()))
        results["ready_s"] = time.perf_counter() - start
        try:

            async def one(prompt: list[int]) -> dict[str, Any]:
                stream = engine.generate(
                    {"prompt_token_ids": prompt}, params, request_id=f"r{next(counter)}"
                )
                return await _consume(stream, lambda o: len(o.outputs[0].token_ids))

            await _one_wave(one, _warmup(folder), 8)
            for c in concurrencies:
                await engine.reset_prefix_cache()
                results[str(c)] = await _measure_wave(one, workload_for_model(folder, wave=c), c)
        finally:
            engine.shutdown()

    asyncio.run(main())
    return results


# ---- transformers -------------------------------------------------------------------------


def _transformers_offline(folder: Path, wl: Workload, repeats: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ready = time.perf_counter() - start
    pad = 0

    def batch(prompts: list[list[int]]) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=wl.output_len,
                min_new_tokens=wl.output_len,
                do_sample=False,
                pad_token_id=pad,
            )

    batch(_warmup(folder))
    seconds = _timed(lambda: batch(wl.prompts), repeats)
    return {
        "ready_s": ready,
        "offline_seconds": seconds,
        "1": _transformers_one_stream(model, wl),
    }


def _transformers_one_stream(model: Any, wl: Workload) -> dict[str, Any]:
    """One request at a time, timed per token through a streamer (no async engine)."""
    import torch

    class Clock:
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    records = []
    start_all = time.perf_counter()
    for prompt in wl.prompts[:C1_REQUESTS]:
        clock = Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=wl.output_len,
                min_new_tokens=wl.output_len,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
        stamps = clock.times[1:]  # the first put() is the prompt itself
        records.append(
            {
                "ttft": stamps[0] - start,
                "gaps": [b - a for a, b in itertools.pairwise(stamps)],
                "tokens": len(stamps),
            }
        )
    return _stream_stats(records, time.perf_counter() - start_all)


# ---- shared ---------------------------------------------------------------------------------


def _warmup(folder: Path) -> list[list[int]]:
    """Warm-up prompts that share nothing with the timed ones (no prefix-cache reuse)."""
    return warmup_workload_for_model(folder, num_requests=8).prompts


def _timed(run: Callable[[], None], repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return seconds


async def _consume(stream: Any, count: Callable[[Any], int]) -> dict[str, Any]:
    """Read one streamed request: TTFT, gaps between token arrivals, tokens."""
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async for out in stream:
        n = count(out)
        if n:
            stamps.append(time.perf_counter())
            tokens += n
    return {
        "ttft": stamps[0] - start,
        "gaps": [b - a for a, b in itertools.pairwise(stamps)],
        "tokens": tokens,
    }


async def _one_wave(
    one: Callable[[list[int]], Any], prompts: list[list[int]], concurrency: int
) -> tuple[list[dict[str, Any]], float]:
    """Run `prompts` with at most `concurrency` in flight; records and wall seconds.

    Plain asyncio (both engines' runs use an asyncio loop): the same code drives both.
    """
    import asyncio

    queue = list(reversed(prompts))
    records: list[dict[str, Any]] = []

    async def worker() -> None:
        while queue:
            records.append(await one(queue.pop()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return records, time.perf_counter() - start


async def _measure_wave(
    one: Callable[[list[int]], Any], wl: Workload, concurrency: int
) -> dict[str, Any]:
    prompts = wl.prompts[:C1_REQUESTS] if concurrency == 1 else wl.prompts
    records, wall = await _one_wave(one, prompts, concurrency)
    return _stream_stats(records, wall)


RUNNERS: dict[tuple[str, str], Callable[..., dict[str, Any]]] = {
    ("asyncengine", "offline"): _asyncengine_offline,
    ("asyncengine", "async"): _asyncengine_async,
    ("asyncengine", "batched"): _asyncengine_batched,
    ("vllm", "offline"): _vllm_offline,
    ("vllm", "async"): _vllm_async,
    ("transformers", "offline"): _transformers_offline,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, choices=("asyncengine", "vllm", "transformers"))
    parser.add_argument("--mode", required=True, choices=("offline", "async", "batched"))
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument(
        "--weights",
        help="a GGUF file asyncengine loads in place of --model-dir (whose "
        "config and tokenizer still shape the workload)",
    )
    args = parser.parse_args()
    runner = RUNNERS.get((args.engine, args.mode))
    if runner is None:
        print(f"{args.engine} has no {args.mode} mode", file=sys.stderr)
        return 2
    folder = Path(args.model_dir)
    if args.weights:
        if args.engine != "asyncengine":
            print(f"--weights: {args.engine} runs folders only", file=sys.stderr)
            return 2
        global _WEIGHTS
        _WEIGHTS = Path(args.weights)
    wl = workload_for_model(folder)
    sampler = _RssSampler()
    if args.mode == "batched":
        record = runner(folder, [int(c) for c in args.concurrency.split(",")], args.repeats)
    elif args.mode == "offline":
        record = runner(folder, wl, args.repeats)
    else:
        record = runner(folder, wl, [int(c) for c in args.concurrency.split(",")])
    record["rss_tree_mb"] = sampler.stop()
    record["num_output_tokens"] = wl.num_output_tokens
    record["threads_env"] = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND",)}
    print(RESULT_PREFIX + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
