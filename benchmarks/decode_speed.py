"""One stream's decode speed, prefill left out, of several forms of one model in process.

    python benchmarks/decode_speed.py --model e [--quant q8_0,q4_k_m] [--rounds 3]

For the benchmark model's bf16 folder and its GGUF files (made by `python -m benchmarks.peers
--quant ...` under .bench/gguf/MODEL), each in its own `LLM` one after another: an 80-token
prompt decoded to 1 token and, with another prompt of the same length (no prefix-cache hit),
to 65; the decode time per token is the difference over 64, the best of `--rounds`. Prints
each file's ms per token and its speed-up over the bf16 folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncengine import LLM, SamplingParams
from benchmarks.models import CACHE_DIR, describe, model_dir

PROMPT_TOKENS = 80
NEW_TOKENS = 64


def decode_seconds(model: str, rounds: int) -> tuple[float, float]:
    """The best per-token decode time and the last prefill time of `model` (a path)."""
    llm = LLM(model, device="cpu", dtype="bfloat16")

    def run(seed: int, max_tokens: int) -> float:
        prompt = [(seed * 7919 + i * 31) % 30000 + 100 for i in range(PROMPT_TOKENS)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    run(0, 4)  # warm-up
    best, prefill = float("inf"), 0.0
    for r in range(rounds):
        prefill = run(10 + 2 * r, 1)
        best = min(best, (run(11 + 2 * r, NEW_TOKENS + 1) - prefill) / NEW_TOKENS)
    llm.shutdown()
    return best, prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="e")
    parser.add_argument("--quant", default="q8_0,q4_k_m")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    files = {"bf16": str(model_dir(args.model))}
    for q in filter(None, args.quant.split(",")):
        path = CACHE_DIR / "gguf" / args.model / f"model-{q.lower()}.gguf"
        if not path.exists():
            parser.error(f"{path} is missing: make it with benchmarks.peers --quant {q}")
        files[q.upper()] = str(path)
    print(f"{describe(args.model)}: {PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens")
    base = None
    for name, path in files.items():
        seconds, prefill = decode_seconds(path, args.rounds)
        base = base or seconds
        print(f"{name}: decode {seconds * 1e3:.1f} ms a token ({1 / seconds:.1f} tok/s), "
              f"{base / seconds:.2f}x bf16's; prefill {prefill:.3f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
