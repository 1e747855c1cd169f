"""Batched embeddings: asyncengine's `LLM.embed` against transformers' `AutoModel` forward on
the same batch, in the same run, on the same number of threads.

    python benchmarks/embeddings.py [--model default] [--inputs 64] [--tokens 128]
                                    [--repeats 5] [--dtype bfloat16] [--pooling mean]

`--inputs` prompts of `--tokens` random token ids each (no special tokens), embedded by both
in turn, `--repeats` times interleaved; prints each one's median seconds, inputs per second,
and asyncengine's speed-up. transformers runs the batch as one padded-free [inputs, tokens]
forward under inference_mode with torch's threads; the engine as it serves (its own step
budget, chunked prefill). Pooling is applied to both (mean by default: the whole
`last_hidden_state` is read). Compare ratios: the machine's speed drifts between runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pooling", default="mean", choices=("last", "mean", "cls"))
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the engine's step budget"
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModel

    from asyncengine import LLM
    from asyncengine.config import resolve_model

    folder = resolve_model(args.model)
    threads = torch.get_num_threads()
    # both on the same threads: the engine's own governor would lend cores away under load
    llm = LLM(folder, device="cpu", dtype=args.dtype, num_threads=threads, **_engine_kwargs(args))
    vocab = llm.config.model_config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(args.tokens)] for _ in range(args.inputs)
    ]
    model = AutoModel.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    ids = torch.tensor(prompts)

    def ours() -> None:
        llm.embed(prompts, pooling=args.pooling, normalize=False)

    def theirs() -> None:
        with torch.inference_mode():
            hidden = model(ids).last_hidden_state.float()  # [inputs, tokens, hidden]
            if args.pooling == "mean":
                hidden.mean(1)

    times: dict[str, list[float]] = {"asyncengine": [], "transformers": []}
    ours(), theirs()  # warm-up
    for _ in range(args.repeats):
        for name, run in (("asyncengine", ours), ("transformers", theirs)):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{args.inputs} inputs x {args.tokens} tokens, {args.dtype}, {args.pooling} pooling, "
        f"{threads} threads each, model {folder.name}"
    )
    for name, seconds in medians.items():
        print(f"{name:>12}: {seconds:.3f} s median ({args.inputs / seconds:.1f} inputs/s)")
    speedup = medians["transformers"] / medians["asyncengine"]
    print(f"asyncengine / transformers speed-up: {speedup:.2f}x")
    llm.shutdown()
    return 0


def _engine_kwargs(args: argparse.Namespace) -> dict[str, int]:
    if args.max_num_batched_tokens is None:
        return {}
    return {"max_num_batched_tokens": args.max_num_batched_tokens}


if __name__ == "__main__":
    sys.exit(main())
