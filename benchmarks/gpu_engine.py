"""The whole engine on a CUDA device against transformers' `generate`, offline, on random-weight
models of SmolLM2-135M's and Qwen2.5-0.5B's shapes.

    python benchmarks/gpu_engine.py [--seqs 1,64] [--json out.json]

For each model and batch size: `--prompt`-token random prompts, `--new` greedy tokens each
(EOS ignored). transformers' `generate` runs the batch once after a short warm-up; then
`LLM.generate` runs it with each attention backend ("triton", "torch"), after a whole-length
warm-up on other prompts (Triton compiles on first use).
Printed per row: output tokens per second of both, their ratio, and how many sequences agree
with transformers on the first token and on all of them. In bf16 both engines round at
different points, so long greedy runs of random-weight models part ways; the agreement that
shows correctness is fp32's (`--dtype float32`). Without CUDA it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import QWEN2_05B

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m-shapes": (
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-0.5b-shapes": ("qwen2", QWEN2_05B),
}


def _transformers_run(model: Path, prompts: torch.Tensor, new: int, dtype: torch.dtype) -> Any:
    import transformers

    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    hf = hf.cuda().eval()
    ids = prompts.cuda()
    with torch.no_grad():
        hf.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        )
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    tokens = out[:, prompts.shape[1] :].cpu().tolist()
    del hf
    torch.cuda.empty_cache()
    return tokens, seconds


def _engine_run(
    model: Path, prompts: torch.Tensor, new: int, dtype: str, backend: str
) -> tuple[list[list[int]], float]:
    from asyncengine import LLM, SamplingParams

    llm = LLM(
        model, dtype=dtype, device="cuda", attention_backend=backend, kv_cache_memory_bytes=4 << 30
    )
    try:
        # Warm-up on other prompts of the same shape (the timed ones must not hit the prefix
        # cache), whole length: Triton compiles each kernel specialization on first use, and
        # a short warm-up leaves the prefill and longer-context ones to the timed run.
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        llm.generate((prompts + 1).tolist(), params, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts.tolist(), params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="1,64")
    parser.add_argument("--prompt", type=int, default=80)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_engine: no CUDA device here; nothing to measure", file=sys.stderr)
        return 0
    from asyncengine.testing import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, overrides) in SHAPES.items():
            model = build_tiny_model(Path(tmp) / name, arch, dtype=args.dtype, **overrides)
            generator = torch.Generator().manual_seed(0)
            for n in (int(s) for s in args.seqs.split(",")):
                prompts = torch.randint(10, 5000, (n, args.prompt), generator=generator)
                ref, hf_s = _transformers_run(model, prompts, args.new, getattr(torch, args.dtype))
                for backend in ("triton", "torch"):
                    got, ae_s = _engine_run(model, prompts, args.new, args.dtype, backend)
                    row = dict(
                        model=name,
                        seqs=n,
                        backend=backend,
                        asyncengine_tok_s=round(n * args.new / ae_s, 1),
                        transformers_tok_s=round(n * args.new / hf_s, 1),
                        ratio=round(hf_s / ae_s, 2),
                        first_token_agree=sum(a[0] == b[0] for a, b in zip(got, ref, strict=True)),
                        all_tokens_agree=sum(a == b for a, b in zip(got, ref, strict=True)),
                    )
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
