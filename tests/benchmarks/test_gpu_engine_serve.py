"""benchmarks/gpu_engine.py off the GPU: its served-path measurement against a real `asyncengine
serve` of a tiny model on the CPU, its rows and table, its options and its time limits."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

# benchmarks/ sits beside the package at the repository root, which is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import gpu_engine
from benchmarks.gpu_engine import (
    Deadline,
    PhaseTimeout,
    measure_served,
    offline_row,
    serve_args,
    served_row,
    table,
    time_limit,
)


def _serving(model: Path) -> list[psutil.Process]:
    """The `asyncengine serve` processes of `model` still running (zombies aside)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmdline = p.info["cmdline"] or []
        if "serve" in cmdline and str(model) in cmdline and p.info["status"] != "zombie":
            found.append(p)
    return found


HOOKS = Path(__file__).resolve().parents[1] / "entrypoints"  # slow_engine_steps.py


@pytest.mark.timeout(240)
def test_measure_served_streams_from_a_real_server_and_stops_it(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every engine step sleeps 20 ms first: unslowed, the tiny model can finish its 8 tokens
    # before the client's first read, and tokens read together are 0 ms apart.
    monkeypatch.setenv("ASYNCENGINE_TEST_HOOKS", "slow_engine_steps")
    monkeypatch.setenv("SLOW_ENGINE_STEP_S", "0.02")
    # Ahead of the caller's own path (a machine with packages on PYTHONPATH keeps them).
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")]))
    )
    log = tmp_path / "serve.log"
    served = measure_served(
        tiny_llama,
        list(range(10, 42)),
        8,
        dtype="float32",
        engine_args=serve_args(device="cpu", kv_cache_memory_bytes=32 << 20),
        ready_timeout=180,
        request_timeout=60,
        log_path=log,
    )
    assert served["tokens"] == 8
    assert served["ready_s"] > 0
    assert served["ttft_ms"] > 0
    assert served["itl_ms"] > 0
    assert served["ttft_ms"] < 60_000 and served["itl_ms"] < 60_000  # milliseconds, not seconds
    # Stopped with SIGTERM and waited for: nothing of it is left running.
    assert _serving(tiny_llama) == []
    assert "POST /v1/completions" not in log.read_text()  # no access log: it costs time


def test_serve_args_map_onto_the_command_line_flags() -> None:
    from asyncengine.entrypoints.cli import build_parser

    args = serve_args(device="cuda", backend="triton", kv_cache_memory_bytes=4 << 30)
    assert args == [
        "--device", "cuda", "--max-model-len", "512", "--kv-cache-memory-bytes", "4294967296",
        "--attention-backend", "triton",
    ]  # fmt: skip
    parsed = build_parser().parse_args(["serve", "/m", *args])
    assert (parsed.device, parsed.attention_backend) == ("cuda", "triton")
    assert "--enforce-eager" in serve_args(device="cuda", enforce_eager=True)


def test_served_row_sits_beside_the_same_engine_in_process() -> None:
    rows = [
        offline_row("m", 1, "triton", False, 64, ([[1] * 64], 0.5), None),  # 128 tok/s
        offline_row("m", 1, "triton", True, 64, ([[1] * 64], 1.0), None),
        offline_row("m", 64, "triton", False, 64, ([[1] * 64] * 64, 1.0), None),
    ]
    served = {"ready_s": 3.0, "ttft_ms": 20.0, "itl_ms": 9.375, "tokens": 64}
    row = served_row("m", "triton", False, served, rows)
    assert row["inprocess_itl_ms"] == pytest.approx(1000 / 128, abs=1e-3)
    assert row["itl_ratio"] == 1.2
    assert served_row("m", "triton", True, served, rows)["inprocess_itl_ms"] == 15.625
    # No in-process row at one sequence (e.g. --seqs 64): the ratio is left out, not made up.
    alone = served_row("m", "torch", False, served, rows)
    assert alone["inprocess_itl_ms"] is None and alone["itl_ratio"] is None


def test_offline_row_compares_with_transformers() -> None:
    row = offline_row("m", 2, "torch", True, 4, ([[1, 2, 3, 4], [5, 6, 7, 8]], 0.5), None)
    assert row["asyncengine_tok_s"] == 16.0 and "ratio" not in row
    ref = ([[1, 2, 3, 4], [5, 0, 0, 0]], 1.0)
    row = offline_row("m", 2, "torch", True, 4, ([[1, 2, 3, 4], [5, 6, 7, 8]], 0.5), ref)
    assert (row["ratio"], row["first_token_agree"], row["all_tokens_agree"]) == (2.0, 2, 1)


def test_table_has_a_line_per_row_and_blank_cells_for_missing_figures() -> None:
    rows = [
        offline_row("m", 1, "triton", False, 64, ([[1] * 64], 0.5), None),
        served_row("m", "triton", False, {"ttft_ms": 2.5, "itl_ms": 9.0}, []),
    ]
    lines = table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0].startswith("| model | path | seqs | backend | eager |")
    assert "| m | served | 1 | triton | False |" in lines[3]
    assert "| 2.5 | 9.0 |" in lines[3]


def test_options() -> None:
    args = gpu_engine._parse_args(["--seqs", "1,64", "--eager"])
    assert (args.seqs, args.eager_seqs, args.backends) == ([1, 64], [1, 64], ["triton"])
    args = gpu_engine._parse_args(["--eager", "1", "--backends", "triton,torch", "--serve"])
    assert (args.eager_seqs, args.backends, args.serve) == ([1], ["triton", "torch"], True)
    args = gpu_engine._parse_args(["--models", "qwen2.5-0.5b-shapes"])
    assert (args.models, args.eager_seqs) == (["qwen2.5-0.5b-shapes"], [])
    with pytest.raises(SystemExit):
        gpu_engine._parse_args(["--models", "gpt-5-shapes"])


def test_without_cuda_it_says_so_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_engine.torch.cuda, "is_available", lambda: False)
    assert gpu_engine.main(["--serve", "--eager"]) == 0
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.timeout(20)
def test_a_phase_past_its_limit_is_stopped_noted_and_the_run_goes_on() -> None:
    with pytest.raises(PhaseTimeout), time_limit(0.2, "nap"):
        time.sleep(10)
    deadline = Deadline(total_s=60, phase_s=0.2)
    assert gpu_engine._run_phase(deadline, "nap", time.sleep, 10) is None
    assert gpu_engine._run_phase(deadline, "sum", sum, [1, 2]) == 3
    assert deadline.failed == ["nap: PhaseTimeout: nap ran past its 0.2 s"]
    late = Deadline(total_s=1, phase_s=10, start=time.monotonic() - 5)
    assert gpu_engine._run_phase(late, "late", sum, [1]) is None
    assert late.skipped == ["late"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("serve_has_eager", [True, False])
def test_main_runs_every_phase_and_writes_every_row(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    serve_has_eager: bool,
) -> None:
    # The GPU runs faked (fixed times), the loop, rows, JSON and table real.
    calls: list[tuple[object, ...]] = []

    def engine_run(model, prompts, new, dtype, backend, eager):  # type: ignore[no-untyped-def]
        calls.append(("engine", len(prompts), backend, eager))
        return [[1] * new] * len(prompts), 0.5

    def served(model, prompt, new, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(("served", tuple(kwargs["engine_args"])))
        return {"ready_s": 1.0, "ttft_ms": 5.0, "itl_ms": 10.0, "tokens": new}

    monkeypatch.setattr(gpu_engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_engine, "SHAPES", {"tiny": ("llama", {})})
    monkeypatch.setattr(gpu_engine, "_transformers_run", lambda m, p, n, d: ([[1] * n] * len(p), 1))
    monkeypatch.setattr(gpu_engine, "_engine_run", engine_run)
    monkeypatch.setattr(gpu_engine, "measure_served", served)
    monkeypatch.setattr(gpu_engine, "serve_takes_enforce_eager", lambda: serve_has_eager)
    out = tmp_path / "rows.json"
    argv = ["--seqs", "1,4", "--new", "8", "--eager", "1", "--serve", "--json", str(out)]
    assert gpu_engine.main(argv) == 0
    engine_calls = [c[1:] for c in calls if c[0] == "engine"]
    assert engine_calls == [(1, "triton", False), (1, "triton", True), (4, "triton", False)]
    served_args = [c[1] for c in calls if c[0] == "served"]
    assert len(served_args) == (2 if serve_has_eager else 1)
    assert all("--device" in a and "cuda" in a for a in served_args)
    assert ["--enforce-eager" in a for a in served_args] == [False, True][: len(served_args)]
    rows = gpu_engine.json.loads(out.read_text())
    assert [(r["path"], r["seqs"], r["enforce_eager"]) for r in rows] == [
        ("offline", 1, False), ("offline", 1, True), ("offline", 4, False),
        ("served", 1, False), *([("served", 1, True)] if serve_has_eager else []),
    ]  # fmt: skip
    assert rows[3]["inprocess_itl_ms"] == 62.5 and rows[3]["itl_ratio"] == 0.16  # 16 tok/s
    printed = capsys.readouterr().out
    assert printed.count("\n{") == len(rows) - 1  # a JSON line per row (the first starts it)
    assert "| model | path |" in printed
