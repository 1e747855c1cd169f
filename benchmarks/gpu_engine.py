"""The whole engine on a CUDA device against transformers' `generate`, offline, on random-weight
models of SmolLM2-135M's and Qwen2.5-0.5B's shapes; and, with `--serve`, the same engine behind
`asyncengine serve`, one stream at a time.

    python benchmarks/gpu_engine.py [--models NAME,...] [--seqs 1,64] [--backends triton,torch]
                                    [--eager [SEQS]] [--serve] [--deadline S] [--json out.json]

Offline, for each model and batch size: `--prompt`-token random prompts, `--new` greedy tokens
each (EOS ignored). transformers' `generate` runs the batch once after a short warm-up; then
`LLM.generate` runs it with each attention backend of `--backends`, after a whole-length
warm-up on other prompts (Triton compiles on first use), with CUDA graphs (the default) and,
for the batch sizes `--eager` names (all of `--seqs` when it names none), without them
(`enforce_eager=True`).
Printed per row: output tokens per second of both, their ratio, and how many sequences agree
with transformers on the first token and on all of them. In bf16 both engines round at
different points, so long greedy runs of random-weight models part ways; the agreement that
shows correctness is fp32's (`--dtype float32`).

`--serve`, for each model, backend and graphs setting: `asyncengine serve` on 127.0.0.1, one
warm-up stream, then one timed streamed `/v1/completions` request (the same prompt length,
`--new` tokens, greedy, EOS ignored). Printed: time to first token, the mean inter-token latency
(ITL), the in-process ITL of the same engine (1000 / tok/s of the offline row at one sequence)
and their ratio: what the HTTP server, the client process and the SSE stream add per token.

Every row is one JSON line as it comes, and `--json` is rewritten after each, so an
interrupted run keeps what it measured; a markdown table of all rows ends the run. Each phase
(a model's transformers run, an engine run, a served run) gets at most `--phase-timeout`
seconds, and none starts past `--deadline` seconds from the start: what is left is skipped with
a printed note (exit status 1 when anything failed or was skipped). Without CUDA it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import QWEN2_05B
from benchmarks.peers.http_load import StreamTally, stream_one
from benchmarks.peers.report import markdown_table
from benchmarks.peers.servers import asyncengine_command, free_port, running_server

REPO = Path(__file__).resolve().parent.parent

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

KV_CACHE_BYTES = 4 << 30
SERVE_MAX_MODEL_LEN = 512
# After the deadline, the phase in flight has this long to end before the process exits anyway
# (a hang that the phase's own alarm could not interrupt, e.g. inside a shutdown).
_HARD_EXIT_GRACE_S = 60.0


# ---- in-process runs ---------------------------------------------------------------------------


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
    model: Path, prompts: torch.Tensor, new: int, dtype: str, backend: str, enforce_eager: bool
) -> tuple[list[list[int]], float]:
    from asyncengine import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        device="cuda",
        attention_backend=backend,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        enforce_eager=enforce_eager,
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


# ---- the served path ---------------------------------------------------------------------------

# The process groups of the servers running now: the hard exit stops them too.
_LIVE_SERVERS: set[int] = set()


def serve_args(
    *,
    device: str,
    backend: str | None = None,
    enforce_eager: bool = False,
    max_model_len: int = SERVE_MAX_MODEL_LEN,
    kv_cache_memory_bytes: int | None = None,
) -> list[str]:
    """The engine flags of the served runs (after `asyncengine serve MODEL --host --port`)."""
    args = ["--device", device, "--max-model-len", str(max_model_len)]
    if kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    if backend is not None:
        args += ["--attention-backend", backend]
    if enforce_eager:
        args.append("--enforce-eager")
    return args


def serve_takes_enforce_eager() -> bool:
    """Whether `asyncengine serve` has the `--enforce-eager` flag (an engine keyword that the
    command line may not map yet)."""
    from asyncengine.entrypoints.cli import ENGINE_KWARGS

    return "enforce_eager" in ENGINE_KWARGS


def measure_served(
    model: Path,
    prompt: Sequence[int],
    new: int,
    *,
    dtype: str,
    engine_args: Sequence[str],
    ready_timeout: float = 300.0,
    request_timeout: float = 120.0,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """Serve `model` (`asyncengine serve` on a free port of 127.0.0.1 with `engine_args`), stream
    one warm-up completion and then one timed one of `new` tokens on `prompt` (token ids); stop
    the server with SIGTERM (it drains) and wait for it.

    Returns `ready_s` (from the server's start until /health and /v1/models answer 200), `ttft_ms`,
    `itl_ms` (the mean time between tokens after the first: an event carrying k tokens counts
    as k gaps of its delay / k; None for one token) and `tokens`. Raises
    benchmarks.peers.servers.ServerError when the server exits or is not ready in time, and
    benchmarks.peers.http_load.LoadError when the stream fails or ends short.
    """
    port = free_port()
    name = model.name
    command = asyncengine_command(
        model, port, served_model_name=name, dtype=dtype, extra_args=engine_args
    )
    # `python -m asyncengine...` from any working directory: this checkout first on the path.
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    with running_server(
        command,
        f"http://127.0.0.1:{port}",
        env=env,
        log_path=log_path,
        ready_timeout=ready_timeout,
        ready_paths=("/health", "/v1/models"),
    ) as server:
        _LIVE_SERVERS.add(server.pid)
        try:
            # Other token ids of the same length first: the timed prompt must not hit the
            # prefix cache, and the warm-up compiles what the timed request needs.
            warmup = [t + 1 for t in prompt]
            tally = asyncio.run(
                _warm_then_timed(server.base_url, warmup, prompt, new, name, request_timeout)
            )
        finally:
            _LIVE_SERVERS.discard(server.pid)
    assert tally.ttft is not None  # stream_one raised unless `new` (>= 1) tokens came
    return dict(
        ready_s=round(server.ready_s, 2),
        ttft_ms=round(tally.ttft * 1000, 3),
        itl_ms=round(1000 * sum(tally.itl) / len(tally.itl), 3) if tally.itl else None,
        tokens=tally.tokens,
    )


async def _warm_then_timed(
    base_url: str,
    warmup: Sequence[int],
    prompt: Sequence[int],
    new: int,
    model: str,
    request_timeout: float,
) -> StreamTally:
    """The timed stream's tally, after the warm-up stream (aiohttp: asyncio only)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await stream_one(session, base_url, warmup, new, model)
        return await stream_one(session, base_url, prompt, new, model)


# ---- phases under a deadline -------------------------------------------------------------------


class PhaseTimeout(Exception):
    """A phase ran past its time limit."""


@dataclass(slots=True)
class Deadline:
    """The run's time budget: `total_s` from its start, at most `phase_s` for any one phase."""

    total_s: float
    phase_s: float
    start: float = field(default_factory=time.monotonic)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    def phase_limit(self) -> float:
        return min(self.phase_s, self.left())

    def may_start(self, what: str, min_s: float = 5.0) -> bool:
        """Whether `what` may start now; if not, it is noted as skipped."""
        if self.left() >= min_s:
            return True
        print(f"gpu_engine: deadline reached: skipped {what}", file=sys.stderr, flush=True)
        self.skipped.append(what)
        return False


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise PhaseTimeout in the block after `seconds` (SIGALRM: the main thread only)."""

    def alarm(signum: int, frame: Any) -> None:
        raise PhaseTimeout(f"{what} ran past its {seconds:.3g} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _run_phase(deadline: Deadline, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` under the phase's time limit; None (noted) when it may not start,
    times out or fails."""
    if not deadline.may_start(what):
        return None
    try:
        with time_limit(deadline.phase_limit(), what):
            return fn(*args, **kwargs)
    except Exception as exc:
        print(f"gpu_engine: {what} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        deadline.failed.append(f"{what}: {type(exc).__name__}: {str(exc)[:300]}")
        return None


def _hard_exit_after(
    seconds: float, rows: list[dict[str, Any]], path: Path | None
) -> threading.Timer:
    """The backstop: a phase stuck where its alarm cannot reach ends the process, its servers
    with it, after writing what was measured. Cancel the timer returned when the run ends."""

    def fire() -> None:
        print(f"gpu_engine: still running {seconds:.0f} s after the start: exiting", flush=True)
        _save(rows, path)
        for pgid in list(_LIVE_SERVERS):
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


# ---- rows and the table ------------------------------------------------------------------------


def offline_row(
    model: str,
    seqs: int,
    backend: str,
    enforce_eager: bool,
    new: int,
    engine: tuple[list[list[int]], float],
    reference: tuple[list[list[int]], float] | None,
) -> dict[str, Any]:
    got, ae_s = engine
    row: dict[str, Any] = dict(
        path="offline",
        model=model,
        seqs=seqs,
        backend=backend,
        enforce_eager=enforce_eager,
        asyncengine_tok_s=round(seqs * new / ae_s, 1),
    )
    if reference is not None:
        ref, hf_s = reference
        row.update(
            transformers_tok_s=round(seqs * new / hf_s, 1),
            ratio=round(hf_s / ae_s, 2),
            first_token_agree=sum(a[0] == b[0] for a, b in zip(got, ref, strict=True)),
            all_tokens_agree=sum(a == b for a, b in zip(got, ref, strict=True)),
        )
    return row


def served_row(
    model: str,
    backend: str,
    enforce_eager: bool,
    served: dict[str, Any],
    rows: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """The served run's row, beside the in-process ITL of the same engine at one sequence
    (1000 / its tok/s: the offline row of the same model, backend and graphs setting)."""
    inprocess = next(
        (
            1000 / r["asyncengine_tok_s"]
            for r in rows
            if r["path"] == "offline"
            and (r["model"], r["seqs"], r["backend"], r["enforce_eager"])
            == (model, 1, backend, enforce_eager)
            and r.get("asyncengine_tok_s")
        ),
        None,
    )
    itl = served["itl_ms"]
    return dict(
        path="served",
        model=model,
        seqs=1,
        backend=backend,
        enforce_eager=enforce_eager,
        **served,
        inprocess_itl_ms=None if inprocess is None else round(inprocess, 3),
        itl_ratio=None if inprocess is None or itl is None else round(itl / inprocess, 2),
    )


TABLE_COLUMNS = (
    ("model", "model"),
    ("path", "path"),
    ("seqs", "seqs"),
    ("backend", "backend"),
    ("enforce_eager", "eager"),
    ("asyncengine_tok_s", "engine tok/s"),
    ("transformers_tok_s", "transformers tok/s"),
    ("ratio", "ratio"),
    ("first_token_agree", "agree first"),
    ("all_tokens_agree", "agree all"),
    ("ttft_ms", "TTFT ms"),
    ("itl_ms", "served ITL ms"),
    ("inprocess_itl_ms", "in-process ITL ms"),
    ("itl_ratio", "served / in-process"),
)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """All rows as one markdown table (a blank cell where a row has no such figure)."""
    cells = [["" if r.get(key) is None else str(r[key]) for key, _ in TABLE_COLUMNS] for r in rows]
    return markdown_table([title for _, title in TABLE_COLUMNS], cells)


def _save(rows: list[dict[str, Any]], path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(rows, indent=1))


def _emit(row: dict[str, Any], rows: list[dict[str, Any]], path: Path | None) -> None:
    print(json.dumps(row), flush=True)
    rows.append(row)
    _save(rows, path)


# ---- main --------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=",".join(SHAPES),
        help=f"comma-separated, of: {', '.join(SHAPES)} (default: all)",
    )
    parser.add_argument("--seqs", default="1,64")
    parser.add_argument("--prompt", type=int, default=80)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--backends",
        default="triton",
        help="comma-separated attention backends, of triton, torch (default: triton)",
    )
    parser.add_argument(
        "--eager",
        nargs="?",
        const="all",
        default=None,
        metavar="SEQS",
        help="also run without CUDA graphs (enforce_eager=True), at these "
        "comma-separated batch sizes (default when given alone: all of "
        "--seqs); with --serve, serve eagerly too",
    )
    parser.add_argument(
        "--serve", action="store_true", help="also measure one stream through `asyncengine serve`"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=540.0,
        metavar="S",
        help="start no phase after S seconds (default: 540)",
    )
    parser.add_argument(
        "--phase-timeout",
        type=float,
        default=240.0,
        metavar="S",
        help="most seconds for any one phase (default: 240)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.eager is None:
        args.eager_seqs = []
    elif args.eager == "all":
        args.eager_seqs = list(args.seqs)
    else:
        args.eager_seqs = [int(s) for s in args.eager.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_engine: no CUDA device here; nothing to measure", file=sys.stderr)
        return 0
    from asyncengine.testing import build_tiny_model

    deadline = Deadline(total_s=args.deadline, phase_s=args.phase_timeout)
    rows: list[dict[str, Any]] = []
    backstop = _hard_exit_after(args.deadline + _HARD_EXIT_GRACE_S, rows, args.json)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models:
                arch, overrides = SHAPES[name]
                model = build_tiny_model(Path(tmp) / name, arch, dtype=args.dtype, **overrides)
                _offline_runs(args, name, model, deadline, rows)
                if args.serve:
                    _served_runs(args, name, model, Path(tmp), deadline, rows)
    finally:
        backstop.cancel()
    return _report(rows, deadline)


def _offline_runs(
    args: argparse.Namespace,
    name: str,
    model: Path,
    deadline: Deadline,
    rows: list[dict[str, Any]],
) -> None:
    """For each batch size: transformers once, then the engine per backend and graphs setting."""
    generator = torch.Generator().manual_seed(0)
    for n in args.seqs:
        prompts = torch.randint(10, 5000, (n, args.prompt), generator=generator)
        ref = _run_phase(
            deadline, f"{name} seqs {n} transformers", _transformers_run,
            model, prompts, args.new, getattr(torch, args.dtype),
        )  # fmt: skip
        for backend in args.backends:
            for eager in [False] + ([True] if n in args.eager_seqs else []):
                got = _run_phase(
                    deadline, f"{name} seqs {n} {backend} eager={eager}", _engine_run,
                    model, prompts, args.new, args.dtype, backend, eager,
                )  # fmt: skip
                if got is not None:
                    row = offline_row(name, n, backend, eager, args.new, got, ref)
                    _emit(row, rows, args.json)


def _served_runs(
    args: argparse.Namespace,
    name: str,
    model: Path,
    tmp: Path,
    deadline: Deadline,
    rows: list[dict[str, Any]],
) -> None:
    """One served stream per backend, with graphs and (`--eager`) without."""
    eager_too = args.eager is not None
    if eager_too and not serve_takes_enforce_eager():
        print("gpu_engine: `asyncengine serve` has no --enforce-eager yet: served runs use "
              "graphs only", file=sys.stderr)  # fmt: skip
        eager_too = False
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, 5000, (args.prompt,), generator=generator).tolist()
    for backend in args.backends:
        for eager in [False] + ([True] if eager_too else []):
            engine_args = serve_args(
                device="cuda",
                backend=backend,
                enforce_eager=eager,
                kv_cache_memory_bytes=KV_CACHE_BYTES,
            )
            limit = deadline.phase_limit()
            served = _run_phase(
                deadline, f"{name} served {backend} eager={eager}", measure_served,
                model, prompt, args.new, dtype=args.dtype, engine_args=engine_args,
                ready_timeout=limit, request_timeout=limit,
                log_path=tmp / f"serve-{name}-{backend}-{eager}.log",
            )  # fmt: skip
            if served is not None:
                _emit(served_row(name, backend, eager, served, rows), rows, args.json)


def _report(rows: list[dict[str, Any]], deadline: Deadline) -> int:
    """The table of all rows, then what failed or was skipped; the exit status."""
    print("\n" + table(rows), flush=True)
    for what in deadline.failed:
        print(f"gpu_engine: failed: {what}", file=sys.stderr)
    for what in deadline.skipped:
        print(f"gpu_engine: skipped: {what}", file=sys.stderr)
    return 1 if deadline.failed or deadline.skipped else 0


if __name__ == "__main__":
    sys.exit(main())
