"""asyncengine against vLLM (CPU build) and transformers, side by side in one run.

    python benchmarks/peers.py [--model a|b|c ...] [--engines asyncengine,vllm-1t,...]
        [--python ENGINE=PATH ...] [--repeats 3] [--rounds 1] [--json out.json]
        [--plot-dir docs/img] [--update-doc docs/performance.md]

`nox -s bench_peers` builds one virtualenv per peer and runs this with their interpreters.
Every (model, engine) runs in fresh processes of benchmarks/peer_runner.py: one offline run
(time to ready, throughput), then one async run (1, 16 and 64 concurrent streams) for the
engines that have an async engine (asyncengine's AsyncLLM, vLLM's AsyncLLM). vLLM runs twice:
"1t" with its defaults (one model thread), "2t" with VLLM_CPU_OMP_THREADS_BIND over every
core. The report: every engine's figures, asyncengine's ratios against vLLM's better
setting with the targets, and a PNG per model (throughput and TTFT against concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.child import run_child
from benchmarks.models import MODEL_NAMES, ModelUnavailable, describe, model_dir
from benchmarks.peer_report import (
    CONCURRENCIES,
    FIGURE_HEADER,
    RATIO_HEADER,
    PeerResult,
    figure_rows,
    markdown_table,
    merge_rounds,
    merge_runs,
    ratio_rows,
)
from benchmarks.peer_runner import ASYNCENGINE_SERVING, RESULT_PREFIX

REPO = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "peer_runner.py"
ENGINES = ("asyncengine", "vllm-1t", "vllm-2t", "transformers")
DEFAULT_VLLM_PYTHON = REPO / ".bench" / "venv-vllm" / "bin" / "python"
VLLM_KV_CACHE_GIB = "1"
DOC_BEGIN = "<!-- peers:begin -->"
DOC_END = "<!-- peers:end -->"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: expected 1 or more")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        sys.exit(f"unknown engine(s) {', '.join(unknown)}: choose from {', '.join(ENGINES)}")
    pythons = _pythons(args.python)
    results: list[PeerResult] = []
    failures: list[str] = []
    for name in args.model or ["a"]:
        try:
            folder = model_dir(name)
        except ModelUnavailable as exc:
            print(f"skipping model {name}: {exc}", file=sys.stderr)
            continue
        label = f"{name}: {describe(name)}"
        rounds: dict[str, list[PeerResult]] = {}
        for number in range(args.rounds):
            for engine in round_order(engines, number):
                runs = []
                for mode in ("offline", "async"):
                    if engine == "transformers" and mode == "async":
                        continue  # no async engine; its one-stream latency comes with offline
                    print(f"[{label}] round {number + 1}/{args.rounds}: {engine} {mode} ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    record = _run(engine, mode, folder, pythons[engine], args)
                    if "error" in record:
                        failures.append(f"{engine} {mode} on {name}: {record['error']}")
                        print(f"  FAILED: {record['error']}", file=sys.stderr)
                        continue
                    runs.append(record)
                if runs:
                    result = merge_runs(engine, label, runs)
                    rounds.setdefault(engine, []).append(result)
                    print(f"  {_round_summary(result)}", file=sys.stderr, flush=True)
        results.extend(merge_rounds(rounds[e]) for e in engines if e in rounds)

    report = _report(results, args)
    print(report)
    for failure in failures:
        print(f"\nFAILED: {failure}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [{"engine": r.engine, "model": r.model, **r.data} for r in results], indent=2
            )
        )
    if args.plot_dir:
        for png in _plot(results, Path(args.plot_dir)):
            print(f"plot: {png}", file=sys.stderr)
    if args.update_doc:
        _update_doc(Path(args.update_doc), report, args)
    return 1 if failures else 0


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


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", action="append", choices=MODEL_NAMES)
    parser.add_argument("--engines", default=",".join(ENGINES))
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
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--plot-dir", help="write one PNG per model here")
    parser.add_argument("--update-doc", help="replace the peers section of this markdown file")
    parser.add_argument("--verbose", action="store_true", help="show the runners' stderr")
    return parser.parse_args(argv)


def _pythons(overrides: list[str]) -> dict[str, str]:
    pythons = {
        "asyncengine": sys.executable,
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


def _run(
    engine: str, mode: str, folder: Path, python: str, args: argparse.Namespace
) -> dict[str, Any]:
    if not Path(python).exists():
        return {"error": f"no interpreter at {python} (see `nox -s bench_peers`)"}
    cmd = [
        python,
        str(RUNNER),
        "--engine",
        engine.split("-")[0],
        "--mode",
        mode,
        "--model-dir",
        str(folder),
        "--repeats",
        str(args.repeats),
        "--concurrency",
        ",".join(str(c) for c in CONCURRENCIES),
    ]
    return run_child(
        cmd,
        RESULT_PREFIX,
        timeout=args.timeout,
        verbose=args.verbose,
        env=_env(engine, python),
        cwd=REPO,
    )


def _rounds(args: argparse.Namespace) -> str:
    rounds = getattr(args, "rounds", 1)
    if rounds <= 1:
        return ""
    return (
        f" per round; every engine measured in {rounds} rounds, in alternating order, each "
        "figure the median of the rounds (offline: of all the rounds' timed runs)"
    )


def _settings(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _report(results: list[PeerResult], args: argparse.Namespace) -> str:
    cpus = os.cpu_count()
    return "\n\n".join(
        [
            f"Workload: 64 requests, prompts of 32-128 random tokens, 64 greedy output tokens "
            f"(EOS ignored), bf16; offline: median of {args.repeats} runs{_rounds(args)}; at "
            f"1 stream: 4 requests one after another; {cpus} CPUs; each engine in fresh processes; "
            f"asyncengine's AsyncLLM with {_settings(ASYNCENGINE_SERVING)}, its defaults "
            "otherwise.",
            markdown_table(FIGURE_HEADER, figure_rows(results)),
            "asyncengine against vLLM's better setting (1t or 2t) for each figure:",
            markdown_table(RATIO_HEADER, ratio_rows(results)),
        ]
    )


def _plot(results: list[PeerResult], folder: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: skipping the plots", file=sys.stderr)
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for model in dict.fromkeys(r.model for r in results):
        fig, (tput, ttft) = plt.subplots(1, 2, figsize=(10, 4))
        for r in (r for r in results if r.model == model):
            points = [(c, r.async_tok_s(c), r.latency_ms(c, "ttft_ms")) for c in CONCURRENCIES]
            points = [p for p in points if p[1] is not None]
            if not points:
                continue
            xs = [p[0] for p in points]
            tput.plot(xs, [p[1] for p in points], marker="o", label=r.engine)
            ttft.plot(xs, [p[2] for p in points], marker="o", label=r.engine)
        for ax, title in ((tput, "output tokens/s"), (ttft, "TTFT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(model)
        fig.tight_layout()
        path = folder / f"peers-{model.split(':')[0]}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _update_doc(doc: Path, report: str, args: argparse.Namespace) -> None:
    """Replace what lies between the peers markers (the command, the tables, the plots)."""
    models = " ".join(f"--model {m}" for m in (args.model or ["a"]))
    rounds = getattr(args, "rounds", 1)
    if rounds > 1:
        models += f" --rounds {rounds}"
    images = ""
    if args.plot_dir:
        rel = os.path.relpath(args.plot_dir, doc.parent)
        images = "\n\n" + "\n".join(f"![{m}]({rel}/peers-{m}.png)" for m in (args.model or ["a"]))
    block = (
        f"{DOC_BEGIN}\n```\npython benchmarks/peers.py {models}\n```\n\n{report}{images}\n{DOC_END}"
    )
    text = doc.read_text()
    if DOC_BEGIN in text and DOC_END in text:
        head, rest = text.split(DOC_BEGIN, 1)
        text = head + block + rest.split(DOC_END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## asyncengine against vLLM and transformers\n\n" + block + "\n"
    doc.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
