"""asyncengine against llama.cpp, vLLM (CPU build) and transformers, side by side in one run.

    python -m benchmarks.peers [--model a|b|c|d|e ...] [--engines asyncengine,llama.cpp,...]
        [--modes offline,async,batched,serve] [--python ENGINE=PATH ...] [--repeats 3]
        [--rounds 1] [--quant q8_0,q4_k_m [--quant-only]] [--json run.json] [--plot-dir docs/img]
        [--update-doc [DOC]]
    python -m benchmarks.peers --from-json run.json [--plot-dir ...] [--update-doc [DOC]]

Run from the repository root. `nox -s bench_peers` builds one virtualenv per peer (and
llama.cpp from source) and runs this with their interpreters. Every (model, engine) runs its
modes in fresh processes:

- offline and async (runner.py, in the engine's interpreter): time to ready and throughput
  of the workload; 1, 16 and 64 streams through the in-process async engine (asyncengine's
  AsyncLLM, vLLM's AsyncLLM). vLLM runs twice: "1t" with its defaults (one model thread),
  "2t" with VLLM_CPU_OMP_THREADS_BIND over every core.
- batched: llama-batched-bench's shape (80-token prompts, 64 output tokens, 1/16/64
  sequences): `llama-batched-bench` for llama.cpp, `LLM.generate` for asyncengine.
- serve: every engine's OpenAI-compatible server (`asyncengine serve`, `llama-server`, `vllm
  serve`) driven by one HTTP load generator (http_load.py) from this process: streamed
  /v1/completions, 1/16/64 streams.

llama.cpp gets each model converted to GGUF bf16 by its own converter (llamacpp.py); `--llama-q8`
adds a Q8_0 run, for information only. `--quant q8_0,q4_k_m` adds, per model, runs in which
asyncengine and llama.cpp both serve the same quantized GGUF file, made by llama.cpp's converter and
`llama-quantize` (gguf_quant.py), reported as models of their own ("b: SmolLM2-135M-Instruct, Q8_0
GGUF") with issue 35's targets against llama.cpp and against asyncengine's own bf16 run of the model
(`--quant-only` leaves the bf16 runs out). The report: every engine's figures, asyncengine's ratios
against vLLM's better setting and against llama.cpp with the targets (met only if met in every
round), and a PNG per model (throughput and TTFT against streams). `--json` saves the run
(record.py), after each model so far; `--from-json` makes the report, plots and doc tables again
from a saved run without running anything; `--update-doc` writes this machine kind's tables into
docs/performance.md (doc.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.child import run_child
from benchmarks.models import MODEL_NAMES, ModelUnavailable, describe, model_dir
from benchmarks.peers import llamacpp, record
from benchmarks.peers.doc import update_doc
from benchmarks.peers.gguf_quant import parse_quants, quant_label, quantized_gguf
from benchmarks.peers.http_load import run_load
from benchmarks.peers.plots import write_plots
from benchmarks.peers.report import (
    BATCHED_HEADER,
    CONCURRENCIES,
    FIGURE_HEADER,
    RATIO_HEADER,
    SERVE_HEADER,
    PeerResult,
    batched_rows,
    figure_rows,
    markdown_table,
    merge_rounds,
    merge_runs,
    ratio_rows,
    serve_rows,
)
from benchmarks.peers.runner import (
    ASYNCENGINE_SERVING,
    BATCHED_GEN_LEN,
    BATCHED_PROMPT_LEN,
    RESULT_PREFIX,
)
from benchmarks.peers.servers import asyncengine_command, free_port, running_server, vllm_command
from benchmarks.workload import workload_for_model

REPO = Path(__file__).resolve().parents[2]
RUNNER_MODULE = "benchmarks.peers.runner"
DEFAULT_DOC = REPO / "docs" / "performance.md"
ENGINES = ("asyncengine", "llama.cpp", "vllm-1t", "vllm-2t", "transformers")
MODES = ("offline", "async", "batched", "serve")
# What each engine has: transformers has no async engine and no server (its one-stream
# latency comes with offline); llama.cpp runs only through its own tools.
ENGINE_MODES = {
    "asyncengine": MODES,
    "llama.cpp": ("batched", "serve"),
    "llama.cpp (q8_0)": ("batched", "serve"),
    "vllm-1t": ("offline", "async", "serve"),
    "vllm-2t": ("offline", "async", "serve"),
    "transformers": ("offline",),
}
LLAMA_Q8 = "llama.cpp (q8_0)"
BENCH = REPO / ".bench"
DEFAULT_VLLM_PYTHON = BENCH / "venv-vllm" / "bin" / "python"
VLLM_KV_CACHE_GIB = "1"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    failures: list[str] = []
    if args.from_json:
        run = record.load(Path(args.from_json))
    else:
        run, failures = _measure(args, sys.argv[1:] if argv is None else list(argv))
        if args.json:
            record.save(run, Path(args.json))
    print(_report(run))
    for failure in failures:
        print(f"\nFAILED: {failure}")
    if args.plot_dir:
        for png in write_plots(run.results, Path(args.plot_dir), run.kind):
            print(f"plot: {png}", file=sys.stderr)
    if args.update_doc:
        for name in update_doc(Path(args.update_doc), run):
            print(f"{args.update_doc}: wrote the {name} table", file=sys.stderr)
    return 1 if failures else 0


def _measure(args: argparse.Namespace, argv: list[str]) -> tuple[record.RunRecord, list[str]]:
    """Every round of every model: the run's record, and what failed."""
    if args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: expected 1 or more")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        sys.exit(f"unknown engine(s) {', '.join(unknown)}: choose from {', '.join(ENGINES)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        sys.exit(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    if args.llama_q8 and "llama.cpp" in engines:
        engines.insert(engines.index("llama.cpp") + 1, LLAMA_Q8)
    try:
        quants = parse_quants(args.quant or "")
    except ValueError as exc:
        sys.exit(str(exc))
    # the quantized runs: the engines that read GGUF files
    quant_engines = [e for e in engines if e in ("asyncengine", "llama.cpp")]
    pythons = _pythons(args.python)
    kind, cpu = record.this_cpu()
    date = record.today()  # the day the run starts
    results: list[PeerResult] = []
    per_round: list[list[PeerResult]] = []
    failures: list[str] = []
    for name in args.model or ["a"]:
        try:
            folder = model_dir(name)
        except ModelUnavailable as exc:
            print(f"skipping model {name}: {exc}", file=sys.stderr)
            continue
        variants: list[tuple[str, list[str], Path | None]] = []
        if not (quants and args.quant_only):
            variants.append((f"{name}: {describe(name)}", engines, None))
        for quant in quants:
            try:
                gguf = quantized_gguf(llamacpp.ensure_built(), folder, BENCH / "gguf" / name, quant)
            except Exception as exc:  # a failed build or conversion: report it, go on
                failures.append(f"{quant} GGUF of {name}: {type(exc).__name__}: {exc}")
                continue
            label = f"{name}: {describe(name)}, {quant_label(quant)}"
            variants.append((label, quant_engines, gguf))
        for label, variant_engines, weights in variants:
            _measure_model(
                label, name, folder, weights, variant_engines, modes, pythons, args,
                results, per_round, failures,
            )  # fmt: skip
            if args.json:  # what is measured so far survives a run cut short
                so_far = _record(results, per_round, date, kind, cpu, argv, args)
                record.save(so_far, Path(args.json))
    return _record(results, per_round, date, kind, cpu, argv, args), failures


def _record(
    results: list[PeerResult],
    per_round: list[list[PeerResult]],
    date: str,
    kind: str,
    cpu: str,
    argv: list[str],
    args: argparse.Namespace,
) -> record.RunRecord:
    return record.RunRecord(
        results=list(results),
        rounds=[list(r) for r in per_round],
        date=date,
        cpu=cpu,
        kind=kind,
        command=record.command_line(argv),
        repeats=args.repeats,
    )


def _measure_model(
    label: str,
    name: str,
    folder: Path,
    weights: Path | None,
    engines: list[str],
    modes: list[str],
    pythons: dict[str, str],
    args: argparse.Namespace,
    results: list[PeerResult],
    per_round: list[list[PeerResult]],
    failures: list[str],
) -> None:
    """Every round of one model (`weights`: the GGUF file every engine loads in place of the
    folder; None: the folder), its results added to `results`, `per_round` and `failures`."""
    rounds: dict[str, list[PeerResult]] = {}
    for number in range(args.rounds):
        if len(per_round) <= number:
            per_round.append([])
        runs_of: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
        for engine, mode, batch in round_plan(engines, modes, number):
            what = mode if batch is None else f"{mode} {batch}"
            print(f"[{label}] round {number + 1}/{args.rounds}: {engine} {what} ...",
                  file=sys.stderr, flush=True)  # fmt: skip
            result = _run_mode(engine, mode, name, folder, pythons, args, batch, weights)
            if "error" in result:
                failures.append(f"{engine} {mode} on {label}: {result['error']}")
                print(f"  FAILED: {result['error']}", file=sys.stderr)
                continue
            runs_of[engine].append(result)
        for engine in round_order(engines, number):
            runs = runs_of[engine]
            if runs:
                merged = merge_runs(engine, label, runs)
                rounds.setdefault(engine, []).append(merged)
                per_round[number].append(merged)
                print(f"  {_round_summary(merged)}", file=sys.stderr, flush=True)
    results.extend(merge_rounds(rounds[e]) for e in engines if e in rounds)


def _round_summary(result: PeerResult) -> str:
    """One round's headline figures, for the log: how far the rounds disagree."""

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    return (
        f"offline {num(result.offline_tok_s)} tok/s, 64 streams {num(result.async_tok_s(64))} "
        f"tok/s, TTFT p50 at 64 {num(result.latency_ms(64, 'ttft_ms'))} ms"
    )


def round_order(engines: Sequence[str], number: int) -> list[str]:
    """The engines in round `number`: as given, then reversed, and so on, so that over two
    rounds every engine runs as often early as late in the machine's drifting minutes."""
    return list(engines) if number % 2 == 0 else list(reversed(engines))


def round_plan(
    engines: Sequence[str], modes: Sequence[str], number: int
) -> list[tuple[str, str, int | None]]:
    """The (engine, mode, batch) runs of round `number`: mode by mode (the batched and serve
    modes batch size by batch size or stream count by stream count, `batch` naming it; None
    for the others), every engine that has the mode back to back, in an order that
    alternates from slot to slot and round to round (A B, B A, then B A, A B). The machine's
    bandwidth drifts by a third over minutes, so the runs a ratio compares are taken as
    close together as they can be (one engine's every mode, then the other's, put minutes
    between them), and each engine runs as often first as second."""
    slots: list[tuple[str, int | None]] = []
    for mode in modes:
        sizes: list[int | None] = [None]
        if mode in ("batched", "serve"):
            sizes = list(CONCURRENCIES)
        slots.extend((mode, size) for size in sizes)
    plan = []
    for index, (mode, size) in enumerate(slots):
        for engine in round_order(engines, number + index):
            if mode in ENGINE_MODES[engine]:
                plan.append((engine, mode, size))
    return plan


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--model", action="append", choices=MODEL_NAMES)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--modes", default=",".join(MODES), help="which runs, of each engine that has them"
    )
    parser.add_argument(
        "--llama-q8", action="store_true", help="also llama.cpp on Q8_0 weights (information)"
    )
    parser.add_argument(
        "--quant",
        metavar="Q8_0,Q4_K_M",
        help="also run asyncengine and llama.cpp on the same quantized GGUF files of each "
        "model (q8_0, q4_k_m), made by llama.cpp's tools",
    )
    parser.add_argument(
        "--quant-only",
        action="store_true",
        help="with --quant, run the quantized files only (not the models' bf16 folders)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama.cpp's threads (-t)")  # fmt: skip
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="ENGINE=PATH",
        help="the interpreter (virtualenv) of a peer; vllm applies to both vLLM settings",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed offline runs")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every engine this many times per model, in alternating order; each figure "
        "is the median of the rounds",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--json", help="save the run here (every figure, each round's)")
    parser.add_argument(
        "--from-json",
        metavar="FILE",
        help="run nothing: report, plot and update the doc from a run saved with --json",
    )
    parser.add_argument("--plot-dir", help="write one PNG per model here")
    parser.add_argument(
        "--update-doc",
        nargs="?",
        const=str(DEFAULT_DOC),
        metavar="DOC",
        help="write this machine kind's tables between their markers in DOC "
        "(default: docs/performance.md)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the runners' stderr")
    return parser.parse_args(argv)


def _pythons(overrides: list[str]) -> dict[str, str]:
    pythons = {
        "asyncengine": sys.executable,
        "llama.cpp": sys.executable,  # the converter's interpreter; the rest is native
        LLAMA_Q8: sys.executable,
        "transformers": sys.executable,
        "vllm-1t": str(DEFAULT_VLLM_PYTHON),
        "vllm-2t": str(DEFAULT_VLLM_PYTHON),
    }
    for item in overrides:
        engine, _, path = item.partition("=")
        if not path:
            sys.exit(f"--python {item!r}: expected ENGINE=PATH")
        for key in [k for k in pythons if k == engine or k.startswith(engine + "-")]:
            pythons[key] = path
    return pythons


def _env(engine: str, python: str) -> dict[str, str]:
    env = dict(os.environ)
    if engine.startswith("vllm"):
        env["VLLM_CPU_KVCACHE_SPACE"] = VLLM_KV_CACHE_GIB
        # vLLM asks for Intel's OpenMP (shipped in its venv by intel-openmp) and tcmalloc
        # preloaded; give it what this machine has.
        preload = [str(p) for p in _venv_libs(python, ("libiomp5.so", "libtcmalloc.so*"))]
        preload += [str(p) for p in _system_libs(("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"))]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        if engine == "vllm-2t":
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    return env


def _venv_libs(python: str, patterns: tuple[str, ...]) -> list[Path]:
    lib = Path(python).resolve().parent.parent / "lib"
    return [p for pattern in patterns for p in sorted(lib.glob(pattern))[:1]]


def _system_libs(names: tuple[str, ...]) -> list[Path]:
    for folder in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")):
        for name in names:
            if (folder / name).exists():
                return [folder / name]
    return []


def _run_mode(
    engine: str,
    mode: str,
    name: str,
    folder: Path,
    pythons: dict[str, str],
    args: argparse.Namespace,
    batch: int | None = None,
    weights: Path | None = None,
) -> dict[str, Any]:
    """One engine's run of one mode on one model (batched and serve: of one batch size or
    stream count, or of all; `weights`: a GGUF file to load in place of the folder): its
    figures, or {"error": ...}."""
    batches = list(CONCURRENCIES) if batch is None else [batch]
    try:
        if mode == "serve":
            return _serve(engine, name, folder, pythons, args, batches, weights)
        if engine.startswith("llama.cpp"):
            gguf = weights or _gguf(engine, name, folder)
            tok_s = llamacpp.batched_bench(
                llamacpp.ensure_built(), gguf, prompt_len=BATCHED_PROMPT_LEN,
                gen_len=BATCHED_GEN_LEN, batches=batches, threads=args.threads,
                context_batch=max(CONCURRENCIES),
            )  # fmt: skip
            return {"batched": {str(b): v for b, v in tok_s.items()}}
    except Exception as exc:  # a failed build, conversion or server: report it, go on
        return {"error": f"{type(exc).__name__}: {exc}"}
    return _run(engine, mode, folder, pythons[engine], args, batches, weights)


def _gguf(engine: str, name: str, folder: Path) -> Path:
    """The model as llama.cpp's GGUF: bf16, or Q8_0 for the information-only run."""
    outtype = "q8_0" if engine == LLAMA_Q8 else "bf16"
    return llamacpp.to_gguf(llamacpp.ensure_built(), folder, BENCH / "gguf" / name, outtype)


def _serve(
    engine: str,
    name: str,
    folder: Path,
    pythons: dict[str, str],
    args: argparse.Namespace,
    concurrencies: Sequence[int] = CONCURRENCIES,
    weights: Path | None = None,
) -> dict[str, Any]:
    """The engine's HTTP server under the shared load generator at `concurrencies` streams
    (each wave after its own warm-up requests; see http_load.run_load); `weights`: the GGUF
    file it serves in place of the folder."""
    import asyncio

    port = free_port()
    if engine.startswith("llama.cpp"):
        command = llamacpp.server_command(
            llamacpp.ensure_built(), weights or _gguf(engine, name, folder), port,
            parallel=max(CONCURRENCIES), threads=args.threads,
        )  # fmt: skip
    elif engine.startswith("vllm"):
        command = vllm_command(folder, port, served_model_name=name, python=pythons[engine])
    else:
        # The KV cache llama-server gets (its slots' cells, in the engine's 16-token blocks):
        # the CPU default of 256 MB holds 8,192 tokens of a 1B model, half of that.
        kv_blocks = max(CONCURRENCIES) * llamacpp.SERVER_CTX_PER_SLOT // 16
        command = asyncengine_command(
            weights or folder, port, served_model_name=name, python=pythons[engine],
            extra_args=[*_serving_args(), "--num-kv-blocks", str(kv_blocks)],
        )  # fmt: skip
    variant = f"-{weights.stem}" if weights is not None else ""
    log = BENCH / f"serve-{name}{variant}-{engine.replace(' ', '_')}.log"
    base_url = f"http://127.0.0.1:{port}"
    record: dict[str, Any] = {}
    with running_server(command, base_url, env=_env(engine, pythons[engine]), log_path=log) as srv:
        record["ready_s"] = srv.ready_s
        for c in concurrencies:
            # Each wave on prompts of its own: none is in a prefix cache from an earlier wave.
            prompts = workload_for_model(folder, wave=c).prompts
            record[str(c)] = asyncio.run(run_load(base_url, prompts, c, model=name))
    return {"serve": record}


def _serving_args() -> list[str]:
    """asyncengine serve's flags for ASYNCENGINE_SERVING (the in-process runs' settings)."""
    return [
        arg
        for key, value in ASYNCENGINE_SERVING.items()
        for arg in (f"--{key.replace('_', '-')}", str(value))
    ]


def _run(
    engine: str,
    mode: str,
    folder: Path,
    python: str,
    args: argparse.Namespace,
    concurrencies: Sequence[int] = CONCURRENCIES,
    weights: Path | None = None,
) -> dict[str, Any]:
    if not Path(python).exists():
        return {"error": f"no interpreter at {python} (see `nox -s bench_peers`)"}
    cmd = [
        python,
        "-m",
        RUNNER_MODULE,
        "--engine",
        engine.split("-")[0],
        "--mode",
        mode,
        "--model-dir",
        str(folder),
        "--repeats",
        str(args.repeats),
        "--concurrency",
        ",".join(str(c) for c in concurrencies),
    ]
    if weights is not None:
        cmd += ["--weights", str(weights)]
    if engine.startswith("llama.cpp"):
        return {"error": f"llama.cpp has no {mode} run"}
    return run_child(
        cmd,
        RESULT_PREFIX,
        timeout=args.timeout,
        verbose=args.verbose,
        env=_env(engine, python),
        cwd=REPO,
    )


def _rounds(rounds: int) -> str:
    if rounds <= 1:
        return ""
    return (
        f" per round; every engine measured in {rounds} rounds, the engines' runs of each mode"
        " (batched and serve: of each batch size or stream count) back to back, in alternating"
        " order; each figure the median of the rounds (offline: of all the rounds' timed runs)"
    )


def _settings(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _report(run: record.RunRecord) -> str:
    results, per_round = run.results, run.rounds
    sections = [
        markdown_table(SERVE_HEADER, serve_rows(results)),
        markdown_table(BATCHED_HEADER, batched_rows(results)),
    ]
    return "\n\n".join(
        [
            f"Workload: 64 requests, prompts of 32-128 random tokens, 64 greedy output tokens "
            f"(EOS ignored), bf16; offline: median of {run.repeats} runs{_rounds(len(per_round))}; "
            f"at 1 stream: 4 requests one after another; {run.cpu}; {run.date}; each engine in "
            "fresh processes; "
            f"asyncengine's AsyncLLM with {_settings(ASYNCENGINE_SERVING)}, its defaults "
            "otherwise.",
            "In-process engines (asyncengine's and vLLM's AsyncLLM; offline `generate`):",
            markdown_table(FIGURE_HEADER, figure_rows(results)),
            "Servers under one HTTP load generator (streamed /v1/completions, the same "
            "workload; llama-server with `-np 64 -t THREADS`, each GGUF made by llama.cpp's "
            "own converter from the same folder):",
            sections[0],
            "Offline on llama-batched-bench's shape (80-token prompts, 64 output tokens; output "
            "tokens over the batch's wall time):",
            sections[1],
            "asyncengine against vLLM's better setting (1t or 2t), and against llama.cpp (bf16), "
            "for each figure; a target counts as met only if every round met it:",
            markdown_table(RATIO_HEADER, ratio_rows(per_round)),
        ]
    )
