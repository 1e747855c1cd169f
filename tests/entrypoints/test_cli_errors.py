"""Mistakes on the command line, as a user meets them: the real `asyncengine` command in a
process of its own. A mistake is one line on stderr naming the option or the file, with a
non-zero status; the traceback only with `--log-level debug`; a misspelt option is never taken
for one it abbreviates, and a usage error shows the command's own usage."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"]


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncengine.entrypoints.cli", *argv],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def command_line(command: str, model: Path | str, *flags: str) -> list[str]:
    """`generate MODEL PROMPT ...` or `serve MODEL --port 0 ...`."""
    where = ["hello"] if command == "generate" else ["--port", "0"]
    return [command, str(model), *where, *ENGINE, *flags]


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("asyncengine: error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


BOTH = pytest.mark.parametrize("command", ["generate", "serve"])


@BOTH
def test_device_cuda_without_a_cuda_build_of_torch(command: str, tiny_llama: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("this torch is built with CUDA")
    proc = run_cli(*command_line(command, tiny_llama, "--device", "cuda"))
    assert_one_line_error(proc, "--device cuda", "without CUDA")


@BOTH
def test_a_truncated_checkpoint_names_the_file(
    command: str, tiny_llama: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a download cut short
    assert_one_line_error(run_cli(*command_line(command, model)), str(weights), "truncated")
    weights.write_bytes(data[:5])  # not even a header
    assert_one_line_error(run_cli(*command_line(command, model)), str(weights), "truncated")


@BOTH
def test_a_checkpoint_missing_a_weight_is_refused_not_run_at_random(
    command: str, tiny_llama: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    proc = run_cli(*command_line(command, model, "--device", "cpu"))
    assert_one_line_error(proc, "lacks 1 of the model's weights", "mlp.up_proj")


@BOTH
def test_a_missing_folder_or_config_is_one_line(
    command: str, tiny_llama: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "nope"
    assert_one_line_error(run_cli(*command_line(command, missing)), str(missing))
    no_config = tmp_path / "no-config"
    shutil.copytree(tiny_llama, no_config)
    (no_config / "config.json").unlink()
    assert_one_line_error(run_cli(*command_line(command, no_config)), "config.json")


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_serve_whose_engine_fails_to_start_is_one_line(tiny_llama: Path, api_servers: str) -> None:
    # A failure found in the engine core's process, as it starts (a KV cache too small).
    argv = ["serve", str(tiny_llama), "--port", "0", "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory-bytes", "10", "--api-server-count", api_servers]  # fmt: skip
    proc = run_cli(*argv)
    line = assert_one_line_error(proc, "failed to start", "kv_cache_memory_bytes=10")
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "Application startup failed" not in proc.stdout + proc.stderr

    debug = run_cli(*argv, "--log-level", "debug")
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr  # the full story, when asked for
    assert debug.stderr.strip().splitlines()[-1] == line


@pytest.mark.parametrize(
    "option",
    [["--temperature", "-1"], ["--max-tokens", "0"], ["--top-p", "1.5"], ["--top-k", "-2"]],
)
def test_sampling_options_are_refused_before_the_model_loads(
    option: list[str], tmp_path: Path
) -> None:
    # The model folder does not exist: the sampling option is refused before it is looked at.
    proc = run_cli(*command_line("generate", tmp_path / "nope", *option))
    assert_one_line_error(proc, option[0].removeprefix("--").replace("-", "_"), option[1])


def test_demo_refuses_its_sampling_option_before_the_model_loads() -> None:
    assert_one_line_error(run_cli("demo", "--max-tokens", "0"), "max_tokens")


@pytest.mark.parametrize("command", ["generate", "serve", "demo"])
@pytest.mark.parametrize("option", [["--max-num-seq", "4"], ["--bogus"]])
def test_an_unknown_or_abbreviated_option_shows_the_commands_usage(
    command: str, option: list[str]
) -> None:
    argv = [command] if command == "demo" else [command, "some/model"]
    if command == "generate":
        argv.append("hello")
    proc = run_cli(*argv, *option)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"usage: asyncengine {command} "), proc.stderr
    assert f"unrecognized arguments: {' '.join(option)}" in proc.stderr
