"""Offline throughput: asyncengine against transformers, on one shared workload.

    python benchmarks/throughput.py [--model a|b|c ...] [--engines asyncengine,hf-static,hf-cb]
                                    [--repeats 3] [--rounds 1] [--tensor-parallel-size N]
                                    [--json out.json] [--profile-dir DIR]

Every engine runs in its own fresh subprocess (this script with `--child ENGINE`), which loads
the model, warms up on a few other prompts, times `--repeats` runs of the workload of
benchmarks/workload.py (64 requests, 32–128 token prompts, 64 greedy output tokens, EOS
ignored, bf16) and prints one JSON line. `--rounds R` starts R processes per engine,
interleaved with the other engines', against bursts of load on a shared machine. The parent
prints a markdown table: output tok/s of the median repeat, ratios against hf-static and
hf-cb on the same model, time to ready (constructor / from_pretrained), the fastest repeat's
tok/s, how many requests' greedy tokens equal hf-static's and their mean common prefix (bf16
runs drift apart), the torch threads, and the 1-minute load average when the child finished
(about 2 is this benchmark alone on 2 cores).

Torch threads stay at the machine default in every child (the same for all engines).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.child import run_child
from benchmarks.models import MODEL_NAMES, ModelUnavailable, describe, model_dir
from benchmarks.workload import (
    BenchResult,
    Workload,
    match_fraction,
    mean_common_prefix,
    median,
    render_table,
    warmup_workload_for_model,
    workload_for_model,
)

ENGINES = ("asyncengine", "hf-static", "hf-cb", "asyncengine-tp1")
BASELINES = ("hf-static", "hf-cb")
# With --tensor-parallel-size N > 1, asyncengine at TP=1 runs too, as the peer TP is judged by.
TP1_ENGINE = "asyncengine-tp1"
REFERENCE_ENGINE = "hf-static"  # greedy outputs are compared with this engine's
RESULT_PREFIX = "BENCH_RESULT "

# hf-cb (transformers continuous batching) settings for CPU; see _run_hf_cb.
HF_CB_ATTN = "sdpa"
HF_CB_PAGE_SIZE = 64  # tokens per page; 32-64 measured a little faster than 256 on CPU
HF_CB_MAX_BATCH_TOKENS = 2048  # the same per-step token budget as asyncengine's default
# CB attends over one packed sequence with a dense block-diagonal mask, so attention work per
# step grows with the square of the batch: 16 requests per batch measured ~1.8x faster than 64
# on SmolLM2 here (8 is slower again).
HF_CB_MAX_REQUESTS = 16


# --------------------------------------------------------------------------------------------
# Parent: one subprocess per (model, engine), then the table.
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.child:
        return _child_main(args)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        sys.exit(f"unknown engine(s) {', '.join(unknown)}: choose from {', '.join(ENGINES)}")
    if args.tensor_parallel_size > 1 and "asyncengine" in engines and TP1_ENGINE not in engines:
        engines.append(TP1_ENGINE)
    baselines = (*BASELINES, TP1_ENGINE) if TP1_ENGINE in engines else BASELINES
    models = args.model or ["a"]

    folders: dict[str, Path] = {}
    for name in models:
        try:
            folders[name] = model_dir(name)
        except ModelUnavailable as exc:
            print(f"skipping model {name} ({describe(name)}): {exc}", file=sys.stderr)

    # Rounds interleave the engines (A B C A B C ...), so that a burst of load from other
    # users of the machine spreads over all engines instead of hitting one.
    merged: dict[tuple[str, str], BenchResult] = {}
    ready: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    failures: list[str] = []
    for round_index in range(args.rounds):
        for name, folder in folders.items():
            label = f"{name}: {describe(name)}"
            for engine in engines:
                key = (engine, label)
                if any(f.startswith(f"{engine} on model {name}:") for f in failures):
                    continue
                print(
                    f"[round {round_index + 1}/{args.rounds}] [{label}] {engine} ...",
                    file=sys.stderr,
                    flush=True,
                )
                record = _run_child(engine, name, folder, args)
                if "error" in record:
                    failures.append(f"{engine} on model {name}: {record['error']}")
                    print(f"  FAILED: {record['error']}", file=sys.stderr)
                    continue
                outputs.setdefault(key, record.pop("outputs"))
                result = BenchResult.from_json({**record, "model": label})
                print(
                    f"  {result.output_tok_per_s:.1f} tok/s (repeats: "
                    + ", ".join(f"{s:.2f}s" for s in result.generate_seconds)
                    + f"), ready {result.ready_seconds:.2f}s",
                    file=sys.stderr,
                    flush=True,
                )
                ready.setdefault(key, []).append(result.ready_seconds)
                if key in merged:
                    merged[key].generate_seconds += result.generate_seconds
                else:
                    merged[key] = result
    results = list(merged.values())
    for key, r in merged.items():
        r.ready_seconds = median(ready[key])
        # The fastest repeat: the least disturbed by other users of the machine.
        r.extra["best_tok_per_s"] = f"{r.num_output_tokens / min(r.generate_seconds):.1f}"

    for r in results:
        reference = outputs.get((REFERENCE_ENGINE, r.model))
        if reference is not None:
            mine = outputs[(r.engine, r.model)]
            r.extra["identical"] = f"{match_fraction(mine, reference):.0%}"
            r.extra["common_prefix"] = f"{mean_common_prefix(mine, reference):.1f}"

    print(f"\n{_describe_run(args)}\n", flush=True)
    print(
        render_table(
            results,
            baselines,
            extra_columns=[
                ("best tok/s", "best_tok_per_s"),
                (f"identical to {REFERENCE_ENGINE}", "identical"),
                ("common prefix (tok)", "common_prefix"),
                ("threads", "threads"),
                ("load", "load_1m"),
            ],
        ),
        flush=True,
    )
    for failure in failures:
        print(f"\nFAILED: {failure}")
    if args.json:
        payload = {
            "settings": _settings(args),
            "results": [r.to_json() for r in results],
            "failures": failures,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 1 if failures else 0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--model", action="append", choices=MODEL_NAMES, help="benchmark model (repeatable)"
    )
    parser.add_argument(
        "--engines",
        default=",".join(e for e in ENGINES if e != TP1_ENGINE),
        help=f"comma-separated engines ({TP1_ENGINE} joins by itself when TP > 1)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine process")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="fresh processes per engine, interleaved; the median is over all their repeats",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument(
        "--profile-dir",
        help="profile one more run of each engine (cProfile, untimed) into this folder",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per engine")
    parser.add_argument("--verbose", action="store_true", help="show the children's stderr")
    # Internal: what the parent passes to a child.
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1:
        parser.error("--repeats and --rounds must be at least 1")
    return args


def _run_child(engine: str, name: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        engine,
        "--model-dir",
        str(folder),
        "--repeats",
        str(args.repeats),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
    ]
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        cmd += ["--profile", str(Path(args.profile_dir) / f"{engine}-{name}.prof")]
    return run_child(cmd, RESULT_PREFIX, timeout=args.timeout, verbose=args.verbose)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    import platform

    return {
        "repeats": args.repeats,
        "rounds": args.rounds,
        "tensor_parallel_size": args.tensor_parallel_size,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "hf_cb": {
            "attn_implementation": HF_CB_ATTN,
            "page_size": HF_CB_PAGE_SIZE,
            "max_batch_tokens": HF_CB_MAX_BATCH_TOKENS,
            "max_requests_per_batch": HF_CB_MAX_REQUESTS,
        },
    }


def _describe_run(args: argparse.Namespace) -> str:
    return (
        "Workload: 64 requests, prompts of 32-128 random tokens (seed 0), 64 greedy output "
        f"tokens each (EOS ignored), bf16; output tok/s of the median of {args.repeats} "
        f"repeats x {args.rounds} round(s); {os.cpu_count()} CPUs; "
        f"tensor_parallel_size={args.tensor_parallel_size} "
        f"(asyncengine only; {TP1_ENGINE} is asyncengine at 1)."
    )


# --------------------------------------------------------------------------------------------
# Child: one engine, one model; prints one JSON line.
# --------------------------------------------------------------------------------------------


def _child_main(args: argparse.Namespace) -> int:
    t_import = time.perf_counter()
    import torch

    torch.manual_seed(0)
    import_seconds = time.perf_counter() - t_import
    folder = Path(args.model_dir)
    workload = workload_for_model(folder)
    warmup = warmup_workload_for_model(folder)
    runners: dict[str, Callable[..., dict[str, Any]]] = {
        "asyncengine": _run_asyncengine,
        TP1_ENGINE: _run_asyncengine,
        "hf-static": _run_hf_static,
        "hf-cb": _run_hf_cb,
    }
    record = runners[args.child](folder, workload, warmup, args)
    outputs: list[list[int]] = record["outputs"]
    lengths = {len(o) for o in outputs}
    if len(outputs) != workload.num_requests or lengths != {workload.output_len}:
        raise RuntimeError(
            f"{args.child} returned {len(outputs)} outputs of lengths {sorted(lengths)}; "
            f"expected {workload.num_requests} of {workload.output_len} tokens"
        )
    record["extra"]["threads"] = torch.get_num_threads()
    record["extra"]["import_seconds"] = import_seconds
    # Others share the machine: the load average says how much to trust the timings.
    record["extra"]["load_1m"] = os.getloadavg()[0]
    record.update(
        engine=args.child,
        model=str(folder),
        num_requests=workload.num_requests,
        num_output_tokens=workload.num_output_tokens,
    )
    print(RESULT_PREFIX + json.dumps(record), flush=True)
    return 0


def _timed_repeats(
    run: Callable[[], list[list[int]]], repeats: int, profile: str | None
) -> tuple[list[float], list[list[int]]]:
    """Seconds of each of `repeats` calls of `run`, and the last call's outputs.

    With `profile`, one more call runs under cProfile afterwards and its stats go to that
    file: the profiler's overhead never reaches the reported timings.
    """
    seconds: list[float] = []
    outputs: list[list[int]] = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = run()
        seconds.append(time.perf_counter() - start)
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.runcall(run)
        profiler.dump_stats(profile)
    return seconds, outputs


def _run_asyncengine(
    folder: Path, workload: Workload, warmup: Workload, args: argparse.Namespace
) -> dict[str, Any]:
    from asyncengine import LLM, SamplingParams

    config: dict[str, Any] = {"dtype": workload.dtype}
    if args.tensor_parallel_size != 1 and args.child != TP1_ENGINE:
        config["tensor_parallel_size"] = args.tensor_parallel_size
    start = time.perf_counter()
    llm = LLM(str(folder), **config)
    ready_seconds = time.perf_counter() - start

    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
    llm.generate(warmup.prompts, params, use_tqdm=False)

    def run() -> list[list[int]]:
        # Every repeat starts from an empty prefix cache: the same prompts again must not skip
        # their prefill, or repeats would measure something the other engines do not do.
        reset = getattr(llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        outs = llm.generate(workload.prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    seconds, outputs = _timed_repeats(run, args.repeats, args.profile)
    shutdown = getattr(llm, "shutdown", None)
    if shutdown is not None:
        shutdown()
    return {
        "generate_seconds": seconds,
        "ready_seconds": ready_seconds,
        "outputs": outputs,
        "extra": {},
    }


def _load_hf(folder: Path, **kwargs: Any) -> tuple[Any, float]:
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kwargs)
    model.eval()  # type: ignore[no-untyped-call]
    return model, time.perf_counter() - start


def _pad_id(model: Any) -> int:
    for candidate in (model.config.pad_token_id, model.generation_config.pad_token_id, 0):
        if isinstance(candidate, int):
            return candidate
    return 0


def _run_hf_static(
    folder: Path, workload: Workload, warmup: Workload, args: argparse.Namespace
) -> dict[str, Any]:
    import torch

    model, ready_seconds = _load_hf(folder)
    pad_id = _pad_id(model)

    def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, S]
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, S]
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids, mask

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        ids, mask = left_padded(prompts)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=workload.output_len,
                min_new_tokens=workload.output_len,  # EOS masked until 64 tokens: ignore_eos
                do_sample=False,
                pad_token_id=pad_id,
            )
        return [row.tolist() for row in out[:, ids.shape[1] :]]  # [B, 64]

    generate(warmup.prompts)
    seconds, outputs = _timed_repeats(
        lambda: generate(workload.prompts), args.repeats, args.profile
    )
    return {
        "generate_seconds": seconds,
        "ready_seconds": ready_seconds,
        "outputs": outputs,
        "extra": {},
    }


def _run_hf_cb(
    folder: Path, workload: Workload, warmup: Workload, args: argparse.Namespace
) -> dict[str, Any]:
    """transformers' continuous batching (`generate_batch`), set up for CPU.

    - attn_implementation="sdpa": CB accepts sdpa, "paged|eager" or flash; there is no flash
      on CPU, and sdpa measured faster than paged|eager here.
    - An explicit cache size: on CPU, CB sizes its cache as 90% of *system* RAM. The cache
      holds every request at once (no preemption), as asyncengine's does.
    - max_batch_tokens = asyncengine's default max_num_batched_tokens; pages of 64 tokens.
    - At most 16 requests per batch (see HF_CB_MAX_REQUESTS): its sdpa path builds a dense
      mask over the whole packed batch, quadratic in the batch size.
    - A persistent manager: built once by the warm-up and reused by the timed runs, so they
      time generation, not cache allocation (asyncengine allocates its cache at start-up).
    - eos_token_id=-1 disables EOS (CB's own convention), so every request makes 64 tokens.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, ready_seconds = _load_hf(folder, attn_implementation=HF_CB_ATTN)
    max_len = max(len(p) for p in workload.prompts) + workload.output_len
    pages_per_request = -(-max_len // HF_CB_PAGE_SIZE)
    # CB's own rule from its workload hints (one spare page, rounded up to even), set here
    # because the persistent manager is built by the smaller warm-up batch.
    max_blocks_per_request = pages_per_request + 1 + (pages_per_request + 1) % 2
    cb_config = ContinuousBatchingConfig(
        page_size=HF_CB_PAGE_SIZE,
        num_blocks=workload.num_requests * pages_per_request + 8,
        max_batch_tokens=HF_CB_MAX_BATCH_TOKENS,
        max_requests_per_batch=min(HF_CB_MAX_REQUESTS, workload.num_requests),
        max_blocks_per_request=max_blocks_per_request,
        auto_switch_to_flash=False,
        seed=0,
    )
    gen_config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=workload.output_len,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=_pad_id(model),
    )

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        results = model.generate_batch(
            inputs=prompts,
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            persistent_manager=True,
        )
        # generate_batch returns {request_id: GenerationOutput} in input order.
        outs = list(results.values())
        if len(outs) != len(prompts) or any(o.error for o in outs):
            errors = [o.error for o in outs if o.error]
            raise RuntimeError(f"generate_batch: {len(outs)}/{len(prompts)} results, {errors[:3]}")
        return [list(o.generated_tokens) for o in outs]

    generate(warmup.prompts)
    seconds, outputs = _timed_repeats(
        lambda: generate(workload.prompts), args.repeats, args.profile
    )
    model.destroy_cached_continuous_batching_manager()
    return {
        "generate_seconds": seconds,
        "ready_seconds": ready_seconds,
        "outputs": outputs,
        "extra": {},
    }


if __name__ == "__main__":
    sys.exit(main())
