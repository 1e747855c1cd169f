"""The cost of structured outputs: 64 streams, half under a JSON schema, against the same load
unconstrained (throughput and the p50 of each stream's mean inter-token latency); and the
compile time of a 30-field schema, cold and from the cache.

    python benchmarks/structured_outputs.py --model b --streams 64 --max-tokens 64

Both runs use the same prompts, temperature 1.0 and seeds, and do the same work: every
stream generates exactly `max_tokens` tokens (`ignore_eos` for the unconstrained ones; the
schema ends in a string of at least 256 characters, which no constrained stream finishes
within the benchmark's budget). So the ratio is the constraint's cost per step (filling the
bitmask in the core, masking the logits), not a difference in how long streams run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncengine import LLM, RequestOutput, SamplingParams, StructuredOutputsParams
from benchmarks.models import describe, model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "bio": {"type": "string", "minLength": 256},
    },
    "required": ["name", "age", "tags", "active", "role", "bio"],
    "additionalProperties": False,
}


def schema_30_fields(tag: str) -> dict[str, Any]:
    kinds = [{"type": "string", "maxLength": 20}, {"type": "integer"}, {"type": "number"},
             {"type": "boolean"}, {"enum": ["a", "b", "c"]},
             {"type": "array", "items": {"type": "integer"}, "maxItems": 5}]  # fmt: skip
    props = {f"{tag}_{i}": kinds[i % len(kinds)] for i in range(30)}
    return {"type": "object", "properties": props, "required": list(props)}


def run(llm: LLM, streams: int, max_tokens: int, constrained: int) -> dict[str, float]:
    constraint = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=i >= constrained,
            structured_outputs=constraint if i < constrained else None,
        )
        for i in range(streams)
    ]
    prompts = [f"Describe user number {i} as JSON." for i in range(streams)]
    start = time.perf_counter()
    outs: list[RequestOutput] = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    itls = []
    for o in outs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        if m is not None and m.first_token_time and m.last_token_time and n > 1:
            itls.append((m.last_token_time - m.first_token_time) / (n - 1))
    return {"tok_s": tokens / wall, "itl_p50_ms": 1000 * statistics.median(itls), "tokens": tokens}


def compile_times(llm: LLM) -> tuple[float, float]:
    manager = llm.engine.engine_core.scheduler.structured_outputs
    assert manager is not None
    manager.grammar_for(StructuredOutputsParams(json={"type": "object"})).future.result()
    schema = StructuredOutputsParams(json=schema_30_fields(f"f{time.time_ns()}"))
    start = time.perf_counter()
    manager.grammar_for(schema).future.result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    manager.grammar_for(schema).future.result()
    return cold, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for name in args.model or ["b"]:
        llm = LLM(model_dir(name), max_model_len=512)
        run(llm, 8, 8, 4)  # warm-up: compiles the schema, touches every path
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.repeats):
            for label, constrained in (("unconstrained", 0), ("half JSON", args.streams // 2)):
                r = run(llm, args.streams, args.max_tokens, constrained)
                if label not in best or r["tok_s"] > best[label]["tok_s"]:
                    best[label] = r
        cold, cached = compile_times(llm)
        base = best["unconstrained"]["tok_s"]
        print(f"model {name} ({describe(name)}), {args.streams} streams, {args.max_tokens} tokens")
        for label, r in best.items():
            print(
                f"  {label:14s} {r['tok_s']:8.1f} tok/s ({r['tok_s'] / base:.2f}x)  "
                f"ITL p50 {r['itl_p50_ms']:.1f} ms  ({int(r['tokens'])} tokens)"
            )
        print(f"  30-field schema compile: cold {cold * 1000:.1f} ms, cached {cached * 1e6:.0f} us")
        print(json.dumps({"model": name, "runs": best, "compile_cold_s": cold, "cached_s": cached}))
        llm.shutdown()


if __name__ == "__main__":
    main()
